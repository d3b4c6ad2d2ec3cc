"""`kdn bench crossmodel`'s gold questions: asked only of a KB whose text holds the fact, and
scored by the accepted answers (kdn.bench.crossmodel.gold_for, is_right)."""
from kdn.bench.crossmodel import GOLD_QUESTIONS, gold_for, is_right
from kdn.cli.knowledge import bundled_documents


def test_a_gold_question_is_asked_only_of_a_kb_that_holds_its_fact():
    text = "He shall hold his Office during the Term of four\nYears, and, together with the Vice President"
    assert [q for q, _ in gold_for(text)] == ["For how many years does the President hold office?"]
    assert gold_for("We hold these truths to be self-evident") == []
    docs = dict(bundled_documents())
    article_ii = next(t for n, t in docs.items() if "article-ii" in n)
    assert len(gold_for(article_ii)) == 3          # the term, the age, the Commander in Chief
    facts = " ".join(" ".join(t.lower().split()) for t in docs.values())
    assert all(needle in facts for _, needle, _ in GOLD_QUESTIONS)


def test_an_answer_is_right_when_it_names_an_accepted_answer():
    ok = dict((q, ok) for q, _, ok in GOLD_QUESTIONS)["For how many years does the President hold office?"]
    assert is_right("The President holds office for Four years.", ok)
    assert is_right("4 years", ok) and not is_right("The President holds office for six years.", ok)
