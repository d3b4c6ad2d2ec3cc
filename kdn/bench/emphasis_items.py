"""The items of `kdn bench emphasis`, written by hand as data (no template generates them).

CONFLICTS: a KB of two documents that disagree on one fact, and a question about it. The
operator trusts one document (`trusted`); the answer it gives is `gold`, the other document's is
`other`. Each answer is a list of accepted forms (the first is the canonical one), matched in
the reply as whole words, case-insensitively. The items vary on purpose: five answer kinds
(number, name, date, yes/no, place), ten of each; documents from one sentence to several
paragraphs (LENGTHS says which); questions worded differently, some with an instruction on
the answer's form and most without; and the trusted document marked as newer or official in
most items, and in the rest two sources of like standing (where only the operator knows which
one to trust). Where the trusted document sits in the KB (first
or second) alternates within each kind (kdn.bench.emphasis.build_tasks).

CONTROLS: two documents that do not disagree (the trusted documents of two conflict items);
the operator emphasizes the first, and the question asks about the first or the second.
Their answer is the asked item's gold.

tests/bench/test_emphasis.py checks every item: each document names its own answer and not
the other's, the question names neither.
"""

# --- numbers -----------------------------------------------------------------------------------
_NUMBERS = [
    dict(id="num-garage", kind="number", length="short",
         question="How much does a day in the staff garage cost, in euros?",
         gold=["12", "twelve"], other=["9", "nine"],
         trusted=("parking-2025.md", "Parking rules, 2025 edition: a day in the staff garage costs 12 euros."),
         untrusted=("parking-2021.md", "Parking rules, 2021 edition: a day in the staff garage costs 9 euros.")),
    dict(id="num-ferry", kind="number", length="medium",
         question="How many minutes does the crossing from Harwick to Ostel take?",
         gold=["45", "forty-five", "forty five"], other=["70", "seventy"],
         trusted=("ferry-operator.md",
                  "Harwick Lines, timetable for passengers. Our boats leave Harwick harbour every two hours "
                  "between dawn and dusk. The crossing to Ostel takes 45 minutes in calm weather. Cars must "
                  "be at the gate before boarding closes; foot passengers can buy tickets on board."),
         untrusted=("travel-blog.md",
                    "We took the boat over to Ostel on our second morning. The crossing from Harwick takes 70 "
                    "minutes, so bring a book. There is a small cafe on the upper deck that sells coffee "
                    "and pastries, and the view of the cliffs on the way out is worth it.")),
    dict(id="num-tablets", kind="number", length="medium",
         question="What is the largest number of tablets an adult may take in 24 hours? Reply with the number only.",
         gold=["6", "six"], other=["8", "eight"],
         trusted=("leaflet-revised.md",
                  "Patient information leaflet, revised after the safety review. Adults and children over 12: "
                  "take one or two tablets with water, leaving at least four hours between doses. Do not take "
                  "more than 6 tablets in any period of 24 hours."),
         untrusted=("leaflet-first-print.md",
                    "Patient information leaflet, first printing. Adults and children over 12: take one or two "
                    "tablets with water, leaving at least four hours between doses. Do not take more than "
                    "8 tablets in any period of 24 hours.")),
    dict(id="num-headcount", kind="number", length="long",
         question="How many people does the company employ?",
         gold=["340"], other=["295"],
         trusted=("annual-report-current.md",
                  "Annual report, section 2: our people. This year we opened a second workshop in the old "
                  "mill on the canal, which now houses the repair team and the training room. Hiring picked "
                  "up in the spring, mostly for technicians and for the customer desk, and the apprenticeship "
                  "programme took its largest class so far. The company employs 340 people across both sites. "
                  "Staff turnover fell for the third year running, which the works council attributes to the "
                  "new shift plan and the canteen that finally serves a hot meal in the evening. Sick days "
                  "per person were slightly above the regional average, largely because of the flu wave in "
                  "February. The board thanks every colleague for a demanding but good year, and in "
                  "particular the team that kept the old production line running during the move."),
         untrusted=("annual-report-previous.md",
                    "Annual report, section 2: our people. The year was dominated by the plans for a second "
                    "workshop; the lease on the old mill was signed in the autumn, but no one has moved yet. "
                    "Hiring was cautious while the order book recovered, and the apprenticeship programme "
                    "kept its usual size. The company employs 295 people at its main site. The works council "
                    "and the board agreed a new shift plan, to be tried in the packing hall first, and the "
                    "canteen committee asked again for a hot evening meal. Sick days per person stayed close "
                    "to the regional average. The board thanks every colleague for their patience during a "
                    "year of planning, and looks forward to the move.")),
    dict(id="num-claims", kind="number", length="short",
         question="Within how many days of the expense does a claim have to be filed?",
         gold=["30", "thirty"], other=["60", "sixty"],
         trusted=("finance-wiki.md", "Expense claims must be filed within 30 days of the expense."),
         untrusted=("onboarding-slides.md",
                    "Welcome aboard! Tip: expense claims can be filed up to 60 days after the expense.")),
    dict(id="num-cedar", kind="number", length="short",
         question="How many people fit in the Cedar room?",
         gold=["14", "fourteen"], other=["22", "twenty-two", "twenty two"],
         trusted=("rooms-facilities.md", "Cedar (third floor, east wing) seats 14 people around one table."),
         untrusted=("rooms-booking-tool.md", "Room: Cedar. Capacity: 22. Equipment: screen, whiteboard.")),
    dict(id="num-museum", kind="number", length="medium",
         question="What does an adult ticket to the city museum cost?",
         gold=["15", "fifteen"], other=["11", "eleven"],
         trusted=("museum-prices.md",
                  "Visiting the city museum. Opening hours are ten to six, Tuesday to Sunday. Adult tickets "
                  "cost 15 dollars; children under twelve enter free, and students pay half price with a "
                  "valid card. The garden cafe is open to visitors without a ticket."),
         untrusted=("guidebook-extract.md",
                    "The city museum, in the former customs house, holds the best collection of maritime "
                    "paintings in the region. Entry for adults is 11 dollars and well worth it; allow two "
                    "hours, and do not miss the model ships on the top floor.")),
    dict(id="num-discount", kind="number", length="short",
         question="What percentage discount do members get?",
         gold=["25", "twenty-five", "twenty five"], other=["10", "ten"],
         trusted=("membership-terms.md", "Members get a 25 percent discount on every order."),
         untrusted=("old-flyer.md", "Join today and save 10 percent on all your orders as a member!")),
    dict(id="num-backups", kind="number", length="long",
         question="For how many days are nightly backups kept? Give a number.",
         gold=["90", "ninety"], other=["35", "thirty-five", "thirty five"],
         trusted=("runbook-v3.md",
                  "Runbook, version 3: backups and restores. Every database is backed up each night at "
                  "02:00 by the scheduler on the operations host. The job first takes a consistent snapshot, "
                  "then copies it to the object store in the second data centre, and finally checks the "
                  "copy by restoring its catalogue into a scratch instance. Nightly backups are kept for "
                  "90 days; after that the lifecycle rule of the bucket deletes them, except the backup of "
                  "the first night of each quarter, which is kept for seven years for the auditors. A "
                  "restore is requested through the service desk, and the on-call engineer confirms the "
                  "target and the point in time with the data owner before starting it. Restores of more "
                  "than a terabyte are started outside business hours. Every restore is written up in the "
                  "operations log with its duration."),
         untrusted=("runbook-v2.md",
                    "Runbook, version 2: backups and restores. Every database is backed up each night at "
                    "01:00 by a cron job on the database host itself. The job dumps the database to local "
                    "disk and then copies the dump to the object store. Nightly backups are kept for 35 "
                    "days; older dumps are deleted by a cleanup script that runs on Sundays. Quarterly "
                    "backups are copied by hand to tape and stored in the safe. A restore is requested by "
                    "email to the operations team, which agrees on a time with the requester. Large "
                    "restores may take most of a day. Note the restore in the shared spreadsheet.")),
    dict(id="num-torque", kind="number", length="medium",
         question="What torque, in newton metres, should the wheel bolts be tightened to?",
         gold=["120"], other=["90", "ninety"],
         trusted=("service-bulletin.md",
                  "Service bulletin 14 for the Mirel van, issued by the manufacturer. It corrects the owner's "
                  "manual: after changing a wheel, tighten the wheel bolts to 120 newton metres in a cross "
                  "pattern, and check them again after 50 kilometres."),
         untrusted=("forum-post.md",
                    "Changed a wheel on my Mirel van last weekend. Tightened the bolts to 90 newton metres, "
                    "like it says in my owner's manual, and it has been fine since.")),
]

# --- names -------------------------------------------------------------------------------------
_NAMES = [
    dict(id="name-atlas", kind="name", length="short",
         question="Who leads the Atlas project?",
         gold=["Priya Raman", "Raman", "Priya"], other=["Tomasz Wolski", "Wolski", "Tomasz"],
         trusted=("org-chart-june.md", "Org chart, June: Atlas project - lead: Priya Raman."),
         untrusted=("org-chart-january.md", "Org chart, January: Atlas project - lead: Tomasz Wolski.")),
    dict(id="name-ceo", kind="name", length="medium",
         question="Who is the chief executive of Norland Freight? Answer with a name.",
         gold=["Helena Vogt", "Vogt", "Helena"], other=["Marcus Bell", "Bell", "Marcus"],
         trusted=("press-release.md",
                  "Press release. Norland Freight announces that its board has appointed Helena Vogt as chief "
                  "executive, effective immediately. She joined the company eleven years ago and most "
                  "recently ran its rail division."),
         untrusted=("company-wiki-about.md",
                    "About Norland Freight: founded as a family haulage firm, the company now runs road, rail "
                    "and sea freight in four countries. Chief executive: Marcus Bell. Headquarters: the "
                    "harbour district.")),
    dict(id="name-novel", kind="name", length="short",
         question="Who wrote The Salt Orchard?",
         gold=["Ines Castillo", "Castillo", "Ines"], other=["Oliver Grant", "Grant", "Oliver"],
         trusted=("library-catalogue.md", "The Salt Orchard, a novel by Ines Castillo, second edition."),
         untrusted=("book-club-notes.md",
                    "Next month we read The Salt Orchard by Oliver Grant - bring snacks!")),
    dict(id="name-oncall", kind="name", length="medium",
         question="Who is on call this week?",
         gold=["Dmitri"], other=["Kenji"],
         trusted=("pager-schedule.md",
                  "Pager schedule, updated Monday morning after the swap: this week's on-call engineer is "
                  "Dmitri. Escalate to the team lead if there is no answer within fifteen minutes."),
         untrusted=("team-calendar.md",
                    "Team calendar for the month. Week one: Kenji on call. Sprint review on Thursday, the "
                    "office is closed on Friday afternoon for the move.")),
    dict(id="name-captain", kind="name", length="short",
         question="Name the captain of the rowing team.",
         gold=["Lucia Ferraro", "Ferraro", "Lucia"], other=["Hannah Cole", "Cole", "Hannah"],
         trusted=("club-minutes.md", "The members elected Lucia Ferraro captain of the rowing team."),
         untrusted=("club-website.md", "Rowing team - captain: Hannah Cole. Training on Tuesdays.")),
    dict(id="name-award", kind="name", length="long",
         question="Who won this year's Harbour Prize?",
         gold=["Samuel Osei", "Osei", "Samuel"], other=["Greta Lind", "Lind", "Greta"],
         trusted=("newsletter-winter.md",
                  "Winter newsletter. The evenings are dark, but the association has had a bright season. "
                  "Our autumn lecture series filled the hall every week, and the talk on the history of "
                  "the lighthouse keepers drew more visitors than any event since the museum reopened. The "
                  "volunteers have finished cataloguing the photographs donated by the pilot families, "
                  "nearly four thousand prints, and a selection will be shown in the spring. The jury "
                  "met in November and awarded this year's Harbour Prize to Samuel Osei for his account of "
                  "the dockworkers' strike, written from letters that no historian had read before. The "
                  "prize will be presented at the new year reception. Membership fees are unchanged, and "
                  "the library will be closed for two weeks over the holidays while the shelves are "
                  "repaired."),
         untrusted=("newsletter-autumn.md",
                    "Autumn newsletter. The summer exhibition on harbour cranes closed with record numbers, "
                    "and the association thanks everyone who lent objects and photographs. The lecture "
                    "series starts in October; the programme is enclosed. The shortlist for this year's "
                    "Harbour Prize has been announced, and the favourite is Greta Lind for her study of the "
                    "fishing fleet, which has been widely praised. The jury will meet in November. The "
                    "volunteers are still looking for help with the cataloguing of the photographs donated "
                    "by the pilot families; anyone with an afternoon to spare should contact the "
                    "secretary. Membership fees will be reviewed at the general meeting.")),
    dict(id="name-landlord", kind="name", length="medium",
         question="Whom should tenants contact about repairs?",
         gold=["Adebayo"], other=["Hughes"],
         trusted=("letter-to-tenants.md",
                  "Dear tenants, the building has a new caretaker. From now on please report leaks, broken "
                  "locks and other repairs to Mrs. Adebayo, whose office is next to the bicycle room."),
         untrusted=("notice-board-card.md",
                    "Repairs? Call Mr. Hughes, caretaker, any weekday between eight and four. Emergencies "
                    "at night: use the number on the lift door.")),
    dict(id="name-architect", kind="name", length="short",
         question="Which architect designed the new library?",
         gold=["Farah Haddad", "Haddad", "Farah"], other=["Pieter de Vries", "de Vries", "Vries", "Pieter"],
         trusted=("city-records.md", "The new library was designed by the architect Farah Haddad."),
         untrusted=("newspaper-preview.md",
                    "The new library, designed by Pieter de Vries, is expected to open next year.")),
    dict(id="name-cat", kind="name", length="short",
         question="What is the office cat called?",
         gold=["Biscuit"], other=["Pepper"],
         trusted=("team-page.md", "Our office cat is called Biscuit and sleeps on the printer."),
         untrusted=("visitor-faq.md", "Yes, there is a cat. Her name is Pepper. Please do not feed her.")),
    dict(id="name-chair", kind="name", length="long",
         question="Who chairs the ethics committee?",
         gold=["Nakamura"], other=["Albright"],
         trusted=("committee-terms-2025.md",
                  "Terms of reference of the ethics committee, as amended at the council meeting in March. "
                  "The committee reviews every study that involves people, personal data or animals before "
                  "it starts, and any substantial change to such a study while it runs. It meets on the "
                  "first Wednesday of each month; urgent requests may be reviewed by the chair and two "
                  "members between meetings. The committee is chaired by Professor Nakamura, with the dean "
                  "of research as deputy. Members serve for three years and may be reappointed once. "
                  "Applicants receive a decision within four weeks of a complete submission, and may "
                  "appeal to the council. The secretary keeps the minutes and publishes a yearly summary "
                  "of decisions without the names of applicants."),
         untrusted=("committee-terms-2019.md",
                    "Terms of reference of the ethics committee. The committee reviews studies that involve "
                    "people before they start. It meets four times a year; between meetings the chair may "
                    "approve small changes alone. The committee is chaired by Professor Albright. Members "
                    "are appointed by the council for two years. Applicants normally receive a decision "
                    "after the next meeting. There is no appeal procedure; applicants may resubmit a "
                    "revised study. The secretary keeps the minutes, which are confidential.")),
]

# --- dates -------------------------------------------------------------------------------------
_DATES = [
    dict(id="date-launch", kind="date", length="short",
         question="On what date does the app launch?",
         gold=["October 3", "3 October", "October 3rd", "3rd October", "3rd of October"],
         other=["September 19", "19 September", "September 19th", "19th September", "19th of September"],
         trusted=("launch-plan-final.md", "Final launch plan: the app launches on October 3."),
         untrusted=("launch-plan-draft.md", "Draft launch plan: the app launches on September 19.")),
    dict(id="date-founded", kind="date", length="medium",
         question="In which year was the choral society founded?",
         gold=["1987"], other=["1992"],
         trusted=("society-charter.md",
                  "The choral society was founded in 1987 by eleven singers who met in the back room of "
                  "the railway hotel. Its charter, signed that year, is kept in the town archive."),
         untrusted=("concert-programme.md",
                    "Tonight's concert celebrates the choral society, founded in 1992, and its long "
                    "friendship with the town orchestra. Please switch off your phones.")),
    dict(id="date-applications", kind="date", length="medium",
         question="When is the closing date for applications?",
         gold=["28 February", "February 28", "28th February", "February 28th", "28th of February"],
         other=["15 March", "March 15", "15th March", "March 15th", "15th of March"],
         trusted=("call-for-applications.md",
                  "Call for applications, research fellowships. Candidates send a CV, a two-page proposal "
                  "and two letters of reference. Applications close on 28 February; late applications are "
                  "not considered."),
         untrusted=("department-newsletter.md",
                    "Reminder: the research fellowships are open again this year. Applications close on "
                    "15 March, so there is still plenty of time to ask your referees.")),
    dict(id="date-recycling", kind="date", length="short",
         question="Which day of the week is the recycling collected?",
         gold=["Thursday", "Thursdays"], other=["Monday", "Mondays"],
         trusted=("council-letter.md", "From this month, recycling is collected on Thursdays."),
         untrusted=("neighbour-note.md", "Hi! The recycling goes out on Mondays, just so you know.")),
    dict(id="date-assembly", kind="date", length="medium",
         question="When is the general assembly held? Answer with the date.",
         gold=["June 12", "12 June", "June 12th", "12th June", "12th of June"],
         other=["July 30", "30 July", "July 30th", "30th July", "30th of July"],
         trusted=("invitation.md",
                  "Invitation to the members. The general assembly is held on June 12 in the community "
                  "hall, starting at seven. The agenda and last year's accounts are attached."),
         untrusted=("chat-message.md",
                    "hey all, general assembly is on July 30 I think? same hall as last year. bring your "
                    "membership card")),
    dict(id="date-bridge", kind="date", length="long",
         question="In what year did the Kessel bridge open?",
         gold=["1931"], other=["1928"],
         trusted=("archive-history.md",
                  "From the town archive: the Kessel bridge. For most of the nineteenth century the only "
                  "way across the river was the chain ferry below the mill, which stopped running whenever "
                  "the water was high. A first plan for a bridge, drawn up by the provincial engineers, was "
                  "shelved for lack of money, and a second one was delayed by a quarrel between the two "
                  "banks over who would pay for the approach roads. Construction finally began after the "
                  "flood that destroyed the ferry landing. The steel came by barge from the works upstream, "
                  "and more than two hundred men worked on the piers through two winters. The Kessel bridge "
                  "opened in 1931, with a brass band and a procession of farm carts. It was widened after "
                  "the war, and the original railings are now in the museum garden."),
         untrusted=("tourist-leaflet.md",
                    "Walking tour, stop 4: the Kessel bridge. Look up at the riveted arches: the bridge "
                    "opened in 1928 and was one of the first steel bridges in the province. Before it, "
                    "travellers crossed by a chain ferry just below the old mill, which you can still see "
                    "on the left bank. The bridge was widened after the war, and the original railings "
                    "stand in the museum garden, which is our next stop. Continue along the river path "
                    "for about ten minutes; there are benches and a water fountain on the way.")),
    dict(id="date-holiday", kind="date", length="short",
         question="Which day in December is the office closed?",
         gold=["24", "December 24", "24 December", "24th"], other=["27", "December 27", "27 December", "27th"],
         trusted=("hr-calendar.md", "The office is closed on December 24."),
         untrusted=("intranet-banner.md", "Reminder: office closed December 27!")),
    dict(id="date-magazine", kind="date", length="medium",
         question="In which month does the next issue of the magazine appear?",
         gold=["August"], other=["November"],
         trusted=("editor-letter.md",
                  "A note from the editor: printing costs have forced us to skip the spring issue. The next "
                  "issue appears in August and will be twice the usual length."),
         untrusted=("subscription-page.md",
                    "Subscribe now and get the next issue, out in November, delivered to your door. Four "
                    "issues a year, free postage.")),
    dict(id="date-composer", kind="date", length="medium",
         question="When was the composer Anton Weller born?",
         gold=["1840", "2 April 1840", "April 2, 1840"], other=["1841", "9 April 1841", "April 9, 1841"],
         trusted=("parish-register.md",
                  "Extract from the parish register, checked against the original: Anton Weller, composer, "
                  "born 2 April 1840 in the mill house, baptised three days later."),
         untrusted=("concert-notes.md",
                    "Anton Weller (born 9 April 1841) wrote most of his chamber music in the years after "
                    "his move to the capital.")),
    dict(id="date-registration", kind="date", length="long",
         question="On which date does registration for the conference open?",
         gold=["January 8", "8 January", "January 8th", "8th January", "8th of January"],
         other=["January 20", "20 January", "January 20th", "20th January", "20th of January"],
         trusted=("conference-site.md",
                  "Practical information for the conference. The meeting takes place in the university's "
                  "main building, a short walk from the central station; signs will guide you from the "
                  "station exit. Registration opens on January 8 and closes four weeks before the "
                  "conference. The fee includes lunches, coffee breaks and the conference dinner; the "
                  "excursion on the last afternoon is paid separately. Speakers must register like every "
                  "other participant. A limited number of rooms has been reserved in two hotels near the "
                  "venue at a reduced rate; quote the conference name when booking. The programme will be "
                  "published once the reviews are complete. For questions about visas, write to the "
                  "local organisers, who can send a letter of invitation."),
         untrusted=("call-for-papers.md",
                    "Call for papers. We invite submissions on all aspects of coastal ecology, from "
                    "sediment transport to the management of protected areas. Papers are limited to eight "
                    "pages and are reviewed by at least two members of the programme committee. Authors "
                    "will be notified in December. Registration opens on January 20; at least one author "
                    "of each accepted paper must register. Selected papers will be invited to a special "
                    "issue of the society's journal. Student grants are available; see the website for "
                    "details. We look forward to seeing you by the sea.")),
]

# --- yes / no ----------------------------------------------------------------------------------
_YES_NO = [
    dict(id="yn-dogs", kind="yes/no", length="short",
         question="Can I bring my dog to the office on a Friday? Answer yes or no.",
         gold=["yes"], other=["no"],
         trusted=("office-rules-2025.md", "Since March, dogs are welcome in the office on Fridays."),
         untrusted=("office-rules-2022.md", "Animals of any kind are not allowed in the office.")),
    dict(id="yn-refund", kind="yes/no", length="medium",
         question="If I return an unopened item after a week, do I get my money back?",
         gold=["yes"], other=["no"],
         trusted=("returns-policy.md",
                  "Returns policy. Unopened items may be returned within 30 days of delivery for a full "
                  "refund. Opened items can be exchanged, but not refunded. Keep your receipt."),
         untrusted=("sale-terms.md",
                    "Terms of the clearance sale: all sales are final. Items bought in the sale cannot "
                    "be returned or refunded, opened or unopened.")),
    dict(id="yn-abroad", kind="yes/no", length="medium",
         question="Are employees allowed to work from abroad? Reply with yes or no.",
         gold=["no"], other=["yes"],
         trusted=("hr-policy-current.md",
                  "Remote work policy, current version. Employees may work from home up to three days a "
                  "week. Working from abroad is not permitted, for tax and insurance reasons, not even "
                  "for a few days."),
         untrusted=("hr-policy-pilot.md",
                    "Remote work pilot. During the pilot, employees may work from home up to three days "
                    "a week, and may also work from abroad for up to four weeks a year.")),
    dict(id="yn-vaccine", kind="yes/no", length="short",
         question="Is a yellow fever vaccination required to enter Mirandia?",
         gold=["no"], other=["yes"],
         trusted=("embassy-notice.md",
                  "Embassy of Mirandia: travellers no longer need a yellow fever vaccination to enter."),
         untrusted=("travel-forum.md",
                    "You definitely need the yellow fever jab for Mirandia, they check at the airport.")),
    dict(id="yn-bridge", kind="yes/no", length="medium",
         question="Can cars use the north bridge today?",
         gold=["yes"], other=["no"],
         trusted=("traffic-update-0800.md",
                  "Traffic update, 8:00. The repairs on the north bridge finished overnight. The north "
                  "bridge is open to cars again in both directions; the diversion signs are being removed."),
         untrusted=("traffic-update-yesterday.md",
                    "Traffic update, yesterday 17:00. The north bridge stays closed to cars until further "
                    "notice. Cyclists and pedestrians can still cross. Follow the diversion via the ring road.")),
    dict(id="yn-overtime", kind="yes/no", length="short",
         question="Is overtime paid?",
         gold=["no"], other=["yes"],
         trusted=("collective-agreement.md",
                  "Overtime is not paid out; each hour of overtime is compensated with an hour off."),
         untrusted=("recruiter-email.md", "And of course all overtime is paid at one and a half times the rate.")),
    dict(id="yn-api", kind="yes/no", length="long",
         question="Does the service still support the v1 endpoint? Answer yes or no.",
         gold=["no"], other=["yes"],
         trusted=("changelog-4.0.md",
                  "Changelog, release 4.0. This release completes the migration announced last year. The "
                  "v1 endpoint has been removed; requests to it now receive an error that points to the "
                  "migration guide. All clients must use the v2 endpoint, which accepts the same "
                  "credentials. Pagination in v2 uses cursors instead of page numbers, and timestamps are "
                  "always in UTC. The rate limit has been raised to 600 requests per minute per key. The "
                  "bulk export job now streams its results instead of writing a file first, so large "
                  "exports start sooner. Webhooks are signed with the new key format; the old format is no "
                  "longer accepted. The command-line tool has been updated to match, and older versions of "
                  "the tool will stop working against this release."),
         untrusted=("api-guide-3.2.md",
                    "API guide, release 3.2. The service offers two endpoints. The v1 endpoint is still "
                    "supported and remains the default for existing clients; new clients should prefer v2, "
                    "which adds cursor pagination and UTC timestamps. Both accept the same credentials. The "
                    "rate limit is 300 requests per minute per key. Bulk exports write a file to your "
                    "storage bucket and send a webhook when the file is ready. Webhooks are signed; both "
                    "the old and the new key format are accepted during this release. The command-line tool "
                    "works with both endpoints.")),
    dict(id="yn-gluten", kind="yes/no", length="medium",
         question="Is the bakery's rye bread safe for someone who must avoid gluten?",
         gold=["no"], other=["yes"],
         trusted=("allergen-sheet.md",
                  "Allergen sheet, checked by the food safety officer. Rye bread: contains gluten (rye, and "
                  "wheat flour in the starter). It is not suitable for people with coeliac disease."),
         untrusted=("shop-sign.md",
                    "Try our rye bread - baked every morning, naturally gluten-free and full of flavour!")),
    dict(id="yn-badge", kind="yes/no", length="short",
         question="Do visitors need a badge?",
         gold=["yes"], other=["no"],
         trusted=("security-policy.md", "All visitors must wear a visitor badge at all times."),
         untrusted=("reception-note.md", "Visitors can skip the badge now, just sign the book.")),
    dict(id="yn-library", kind="yes/no", length="long",
         question="Is the central library open on Sundays?",
         gold=["yes"], other=["no"],
         trusted=("library-hours-new.md",
                  "Opening hours of the central library, valid from the first of the month. After the "
                  "consultation last year, in which more than two thousand residents took part, the council "
                  "decided to extend the opening hours of the central library. From Monday to Friday the "
                  "library is open from nine in the morning until eight in the evening, and on Saturdays "
                  "from ten until five. The central library is now also open on Sundays, from noon until "
                  "five, with the reading room, the children's floor and the computer desks available; "
                  "the archive can only be visited on weekdays by appointment. The branch libraries keep "
                  "their current hours. Returns can be made at the book drop at any time, and reservations "
                  "can be collected whenever the library is open."),
         untrusted=("library-hours-old.md",
                    "Opening hours of the central library. From Monday to Friday the library is open from "
                    "nine in the morning until six in the evening, and on Saturdays from ten until one. The "
                    "library is closed on Sundays and on public holidays. The archive can be visited on "
                    "weekdays by appointment. Returns can be made at the book drop at any time. The council "
                    "will consult residents about longer opening hours later this year; a questionnaire is "
                    "available at the information desk.")),
]

# --- places ------------------------------------------------------------------------------------
_PLACES = [
    dict(id="place-hq", kind="place", length="short",
         question="In which city is the company's headquarters?",
         gold=["Rotterdam"], other=["Antwerp"],
         trusted=("registry-entry.md", "Registered office and headquarters: Rotterdam."),
         untrusted=("old-letterhead.md", "Headquarters: Antwerp. Telephone and fax on request.")),
    dict(id="place-offsite", kind="place", length="medium",
         question="Where does this year's team offsite take place?",
         gold=["Lisbon"], other=["Seville"],
         trusted=("offsite-booking.md",
                  "Offsite, booking confirmation. The hotel is booked and the flights are reserved: this "
                  "year's team offsite takes place in Lisbon, from Tuesday to Thursday of the last week of "
                  "the quarter."),
         untrusted=("offsite-poll.md",
                    "Offsite poll results so far: most people voted for Seville, so that is where the team "
                    "offsite will take place. The poll closes on Friday.")),
    dict(id="place-parts", kind="place", length="short",
         question="Which warehouse stores the spare parts?",
         gold=["Northgate"], other=["Riverside"],
         trusted=("inventory-system.md", "Spare parts, all types: stored at the Northgate warehouse."),
         untrusted=("driver-handbook.md", "Spare parts are picked up at the Riverside warehouse.")),
    dict(id="place-painter", kind="place", length="medium",
         question="Where was the painter Maren Holt born? Answer with a city.",
         gold=["Bergen"], other=["Trondheim"],
         trusted=("biography.md",
                  "Maren Holt was born in Bergen, the daughter of a ship's carpenter, and moved to the "
                  "capital at nineteen to study at the academy. Her early seascapes were painted from "
                  "memory of the harbour."),
         untrusted=("auction-catalogue.md",
                    "Lot 112. Maren Holt (born in Trondheim), Harbour at dusk, oil on canvas, signed lower "
                    "right. Estimate on request.")),
    dict(id="place-venue", kind="place", length="long",
         question="Which city hosts the summit?",
         gold=["Graz"], other=["Linz"],
         trusted=("summit-final-info.md",
                  "Final information for delegates. The summit is hosted by the city of Graz, in the "
                  "congress centre in the old town. Delegations arrive on the evening before the opening "
                  "session; a shuttle runs from the airport and the main station every thirty minutes "
                  "until midnight. Badges are collected at the accreditation desk in the entrance hall, "
                  "with a passport or identity card. The opening session starts at nine sharp and the "
                  "doors close at a quarter to nine. Working lunches are served in the upper foyer. The "
                  "closing press conference is open to accredited journalists only. Interpretation is "
                  "provided in the three working languages, and the documents will be published on the "
                  "summit's website after the closing session."),
         untrusted=("summit-save-the-date.md",
                    "Save the date. The next summit will be hosted by the city of Linz, whose mayor has "
                    "offered the new exhibition halls by the river. Dates will be confirmed once the "
                    "member states have agreed on the agenda. Delegations are asked to name their contact "
                    "person by the end of the month. Further information on travel, accommodation and "
                    "accreditation will follow in a separate letter. We look forward to welcoming you.")),
    dict(id="place-lost", kind="place", length="short",
         question="Where should I take something I found in the building?",
         gold=["reception"], other=["security office", "security"],
         trusted=("facilities-page.md", "Lost and found is kept at reception on the ground floor."),
         untrusted=("old-poster.md", "Found something? Bring it to the security office in the basement.")),
    dict(id="place-train", kind="place", length="medium",
         question="From which station does the night train to Vienna leave?",
         gold=["Central Station", "Central"], other=["East Station", "East"],
         trusted=("railway-timetable.md",
                  "Timetable change from Sunday: because of works on the line, the night train to Vienna "
                  "leaves from Central Station, platform 3, at 22:40. Sleeper tickets remain valid."),
         untrusted=("hotel-concierge-tips.md",
                    "For guests travelling on: the night train to Vienna leaves from East Station, a ten-"
                    "minute taxi ride from the hotel. Ask the desk to call a taxi.")),
    dict(id="place-factory", kind="place", length="medium",
         question="To which city did the company move its production?",
         gold=["Monterrey"], other=["Puebla"],
         trusted=("investor-update.md",
                  "Investor update. The move of production is complete: all three lines now run in "
                  "Monterrey, and the first shipments left the new plant on schedule."),
         untrusted=("trade-press-rumour.md",
                    "Sources close to the company say it is moving its production to Puebla, where it has "
                    "been looking at sites since the spring.")),
    dict(id="place-capital", kind="place", length="short",
         question="What is the capital of Velmora?",
         gold=["Astrel"], other=["Korvan"],
         trusted=("atlas-2024.md", "Velmora, capital: Astrel (moved from the coast in 2019)."),
         untrusted=("atlas-2010.md", "Velmora, capital: Korvan, the largest port of the country.")),
    dict(id="place-festival", kind="place", length="long",
         question="At which lake is the music festival held this summer?",
         gold=["Lake Orta", "Orta"], other=["Lake Iseo", "Iseo"],
         trusted=("festival-programme.md",
                  "Festival programme, this summer. After two years on the same meadow the festival moves: "
                  "this summer it is held at Lake Orta, on the grounds of the old rowing club, with the "
                  "main stage facing the island. Camping is on the hill above the village, and a boat "
                  "service runs from the camp to the stage every hour until two in the morning. Day "
                  "tickets go on sale in April; weekend tickets are already available. The line-up "
                  "includes three orchestras, a dozen bands and a night of film music under the stars. "
                  "There is no parking at the site; buses run from the nearest station, and cyclists "
                  "will find guarded racks by the entrance. Bring a refillable bottle: water is free."),
         untrusted=("festival-review-last-year.md",
                    "Review: the festival at Lake Iseo was a triumph again. The meadow by the water was "
                    "packed for the closing night, and the orchestra's encore had the whole crowd singing. "
                    "Camping was better organised than the year before, though the queue for the showers "
                    "on Sunday morning was long. The organisers promise more boats and more food stalls "
                    "next year. If you have never been, this is the summer to go.")),
]

CONFLICTS = _NUMBERS + _NAMES + _DATES + _YES_NO + _PLACES

# (id, emphasized conflict item, other conflict item, which one the question asks about)
CONTROLS = [
    ("ctl-garage-cat", "num-garage", "name-cat", "emphasized"),
    ("ctl-ferry-recycling", "num-ferry", "date-recycling", "other"),
    ("ctl-atlas-hq", "name-atlas", "place-hq", "emphasized"),
    ("ctl-novel-museum", "name-novel", "num-museum", "other"),
    ("ctl-launch-parts", "date-launch", "place-parts", "emphasized"),
    ("ctl-founded-captain", "date-founded", "name-captain", "other"),
    ("ctl-dogs-capital", "yn-dogs", "place-capital", "emphasized"),
    ("ctl-badge-claims", "yn-badge", "num-claims", "other"),
    ("ctl-offsite-overtime", "place-offsite", "yn-overtime", "emphasized"),
    ("ctl-lost-architect", "place-lost", "name-architect", "other"),
    ("ctl-cedar-holiday", "num-cedar", "date-holiday", "emphasized"),
    ("ctl-oncall-discount", "name-oncall", "num-discount", "other"),
    ("ctl-magazine-factory", "date-magazine", "place-factory", "emphasized"),
    ("ctl-vaccine-torque", "yn-vaccine", "num-torque", "other"),
    ("ctl-painter-refund", "place-painter", "yn-refund", "emphasized"),
    ("ctl-assembly-landlord", "date-assembly", "name-landlord", "other"),
]
