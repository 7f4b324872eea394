"""The ceiling's clairvoyant schedule, on a hand-worked case."""

from benchmarks.ceiling import Answer, Costs, guess_hits, lookup_runs, min_decode_seconds, report, runs_from_matches

COSTS = Costs(verify=[0.0, 10.0, 12.0, 14.0, 16.0], draft=3.0)


def test_runs_count_the_matches_ahead_of_each_position():
    assert runs_from_matches([True, True, False, True, True]) == [2, 1, 0, 2, 1]


def test_the_cheapest_schedule_drafts_only_what_pays():
    # Two rounds of two drafted tokens (12+3 and 14+6) beat five single steps (50).
    answer = Answer(prefill_s=0.0, draft_runs=[2, 1, 0, 2, 1], lookup_runs=[0] * 5)
    assert min_decode_seconds(answer, COSTS) == 35.0
    assert min_decode_seconds(Answer(0.0, [0] * 5, [0] * 5), COSTS) == 50.0


def test_a_lookup_copy_costs_only_its_verify_rows():
    answer = Answer(prefill_s=0.0, draft_runs=[2, 1, 0, 2, 1], lookup_runs=[0, 0, 0, 2, 0])
    assert min_decode_seconds(answer, COSTS) == 32.0
    assert min_decode_seconds(answer, COSTS, use_lookup=False) == 35.0


def test_the_report_gives_each_prompt_and_all_of_them():
    costs = Costs(verify=[0.0, 10.0, 12.0, 14.0, 16.0] + [20.0] * 13, draft=3.0)
    answer = Answer(prefill_s=0.0, draft_runs=[2, 1, 0, 2, 1], lookup_runs=[0, 0, 0, 2, 0])
    lines = report([("a", 5, answer), ("b", 5, answer)], costs).splitlines()
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[-3:]]
    assert cells == [["a", "5", "1.43×", "1.56×"], ["b", "5", "1.43×", "1.56×"], ["all", "10", "1.43×", "1.56×"]]


def test_a_right_guess_lets_one_draft_step_draft_two_tokens():
    answer = Answer(
        prefill_s=0.0, draft_runs=[2, 1, 0, 2, 1], lookup_runs=[0] * 5, guess_hits=[True, False, False, True, False]
    )
    assert answer.draft_steps(0, 2) == 1 and answer.draft_steps(3, 1) == 1 and answer.draft_steps(1, 1) == 1
    assert answer.draft_steps(3, 2) == 1
    assert min_decode_seconds(answer, COSTS) == 32.0  # 14 + 3 (one step drafts two), then 12 + 3


def test_lookup_runs_and_guess_hits_along_an_answer():
    assert lookup_runs([1, 2, 3, 4, 5], [1, 2, 3, 9], vocab_size=10) == [0, 0, 1, 0]
    assert guess_hits([1, 2, 3, 1, 2], [3, 7], predictions=[3, 5], vocab_size=10) == [True, False]
