"""`kdn bench emphasis` without the model: its items are real conflicts of varied kinds, its split
is fixed and stratified, and the weight it reports is chosen on the calibration items alone."""
import random
import re

import pytest

from kdn.bench import emphasis as bench
from kdn.bench.emphasis_items import CONFLICTS, CONTROLS

KINDS = {"number", "name", "date", "yes/no", "place"}


def test_every_conflict_is_written_out_and_each_document_names_only_its_own_answer():
    assert len({c["id"] for c in CONFLICTS}) == len(CONFLICTS) >= 50
    assert {c["kind"] for c in CONFLICTS} == KINDS
    assert all(sum(c["kind"] == k for c in CONFLICTS) >= 10 for k in KINDS)
    assert {c["length"] for c in CONFLICTS} == {"short", "medium", "long"}
    for c in CONFLICTS:
        trusted, untrusted = c["trusted"][1], c["untrusted"][1]
        assert c["trusted"][0] != c["untrusted"][0] and trusted != untrusted
        assert not set(map(str.lower, c["gold"])) & set(map(str.lower, c["other"])), c["id"]
        if c["kind"] != "yes/no":                  # a yes/no document states the fact, not "yes"
            assert bench.first_answer(trusted, c["gold"], c["other"]) == "gold", c["id"]
            assert bench.first_answer(untrusted, c["gold"], c["other"]) == "other", c["id"]
            assert bench.first_answer(c["question"], c["gold"], c["other"]) is None, c["id"]
    words = {n: len(c["trusted"][1].split()) for n, c in enumerate(CONFLICTS)}
    assert min(words.values()) < 15 and max(words.values()) > 120          # a sentence to paragraphs
    questions = [c["question"] for c in CONFLICTS]
    assert len(set(questions)) == len(questions)
    assert 0 < sum(bool(re.search(r"Answer|Reply|Give|Name", q)) for q in questions) < len(questions) / 2


def test_the_tasks_alternate_the_trusted_documents_place_and_controls_do_not_conflict():
    tasks = bench.build_tasks()
    conflict = [t for t in tasks if t["set"] == "conflict"]
    control = [t for t in tasks if t["set"] == "control"]
    assert len(conflict) == len(CONFLICTS) and len(control) == len(CONTROLS) >= 12
    for k in KINDS:
        first = [t["docs"][0][0] == t["trusted"] for t in conflict if t["kind"] == k]
        assert abs(sum(first) - len(first) / 2) <= 0.5
    for t in control:
        assert t["other"] is None and t["docs"][0][0] == t["trusted"]
        assert bench.first_answer(" ".join(x for _, x in t["docs"]), t["gold"], None) == "gold" \
            or t["kind"] == "yes/no"
    assert {t["asks_emphasized"] for t in control} == {True, False}
    quick = bench.build_tasks(quick=True)
    assert len([t for t in quick if t["set"] == "conflict"]) == 2 * len(KINDS)
    assert bench.build_tasks() == tasks


def test_the_split_is_fixed_stratified_and_independent_of_the_items_order():
    tasks = bench.build_tasks()
    split = bench.split_items(tasks, seed=0)
    assert set(split) == {t["id"] for t in tasks} and set(split.values()) == {"calibration", "report"}
    for k in KINDS:
        ids = [t["id"] for t in tasks if t["set"] == "conflict" and t["kind"] == k]
        assert sum(split[i] == "calibration" for i in ids) == round(bench.CALIBRATION_SHARE * len(ids))
    shuffled = tasks[:]
    random.Random(1).shuffle(shuffled)
    assert bench.split_items(shuffled, seed=0) == split
    assert bench.split_items(tasks, seed=1) != split
    calibration = sum(v == "calibration" for k, v in split.items() if not k.startswith("ctl-"))
    assert calibration == 20 and len(CONFLICTS) - calibration == 30


def test_the_weight_is_chosen_on_calibration_items_only():
    tasks = [t for t in bench.build_tasks() if t["set"] == "conflict"]
    split = bench.split_items(tasks, seed=0)
    rng = random.Random(7)
    outcomes = {t["id"]: {w: rng.random() < 0.5 for w in (1, 2, 4, 8)} for t in tasks}
    chosen, right = bench.weight_from_calibration(outcomes, split)
    assert sum(right.values()) == sum(sum(outcomes[i].values()) for i in outcomes if split[i] == "calibration")
    for seed in range(20):                        # whatever the report items say, the choice stands
        r = random.Random(seed)
        changed = {i: ({w: r.random() < 0.5 for w in by} if split[i] == "report" else by)
                   for i, by in outcomes.items()}
        assert bench.weight_from_calibration(changed, split) == (chosen, right)
    best_on_report = {i: ({w: w == 2 for w in by} if split[i] == "report" else {w: w == 8 for w in by})
                      for i, by in outcomes.items()}
    assert bench.weight_from_calibration(best_on_report, split)[0] == 8      # not the report's best


def test_choose_weight_takes_the_most_right_and_the_smaller_weight_on_a_tie():
    assert bench.choose_weight({1: 5, 2: 8, 4: 9, 8: 9}) == 4
    assert bench.choose_weight({1: 9, 2: 9, 4: 3}) == 1          # no gain: no emphasis
    with pytest.raises(ValueError):
        bench.choose_weight({})


def test_replies_are_read_by_whole_words_and_degenerate_ones_are_counted():
    assert bench.first_answer("It opens at 8, not 2.", "2", "8") == "other"
    assert bench.first_answer("The lead is priya raman.", ["Priya Raman", "Raman"], ["Wolski"]) == "gold"
    assert bench.first_answer("It costs 120 euros", ["12"], ["20"]) is None
    assert bench.first_answer("The cafeteria is closed on Thursdays.", ["Thursday", "Thursdays"], ["Monday"]) == "gold"
    assert bench.first_answer("No, it is not.", ["yes"], ["no"]) == "other"
    assert not bench.answered("The fee is 1", ["12"], ["9"])       # "12" may still be coming
    assert bench.answered("The fee is 12.", ["12"], ["9"])
    assert not bench.answered("The lead is Priya", ["Priya Raman", "Priya"], ["Tomasz"])
    for text in ("", "  ...", "the the the end", "answer is is is", "a b a b a b a b a b"):
        assert bench.is_degenerate(text), text
    assert not bench.is_degenerate("The garage costs 12 euros a day.")
