"""The scheduler's plans (engine.core.planning), checked on snapshots of requests: no model runs."""

from __future__ import annotations

from engine.core.decoding import PREFILL_CHUNK
from engine.core.pacing import BatchPrices
from engine.core.planning import BATCH_SPREAD, Plan, Seat, plan


def seat(key: int, client: str = "", *, reading: bool = False, unread: int = 1, rounds: int = 1, **fields) -> Seat:
    return Seat(key, client or f"client {key}", reading, unread, rounds, **{"context": 100, **fields})


def anything_fits(rows) -> bool:
    return True


def test_first_rounds_come_first_shortest_read_first_and_the_client_already_answering_last():
    going = [seat(1, "a", rounds=3), seat(2, "b", rounds=5)]
    due = [seat(3, "a", rounds=0, unread=1), seat(4, "c", rounds=0, unread=40), seat(5, "d", rounds=0, unread=20)]
    assert plan([*going, *due], 0, 8, anything_fits) == Plan(first=5)
    assert plan([*going, *due[:2]], 0, 8, anything_fits) == Plan(first=4)  # (client a is answering already)


def test_a_prompt_longer_than_a_chunk_is_side_work_and_a_short_rest_is_read_by_its_first_round():
    long = seat(3, reading=True, rounds=0, unread=PREFILL_CHUNK + 1)
    short = seat(4, reading=True, rounds=0, unread=PREFILL_CHUNK)
    assert plan([seat(1), seat(2), long], 0, 8, anything_fits) == Plan(together=(1, 2), side=(3,))
    assert plan([seat(1), seat(2), long, short], 0, 8, anything_fits).first == 4


def test_after_as_many_first_rounds_in_a_row_as_the_batch_holds_the_others_get_their_step():
    seats = [seat(1, batched=True), seat(2, batched=True), seat(3, rounds=0)]
    assert plan(seats, 7, 8, anything_fits) == Plan(first=3)
    assert plan(seats, 8, 8, anything_fits) == Plan(together=(1, 2))


def test_requests_batch_from_their_second_round_shortest_first_within_the_spread():
    short, mid = seat(1, context=100), seat(2, context=300)
    wide = seat(3, context=2 * 100 + BATCH_SPREAD + 1, side_s=0.5)
    reading = seat(4, reading=True, unread=5000, rounds=0, side_s=0.1)
    assert plan([wide, mid, short, reading], 0, 8, anything_fits) == Plan(together=(1, 2), side=(4, 3))


def test_without_batching_each_request_takes_its_own_round_and_first_rounds_still_come_first():
    short, mid = seat(1, context=100), seat(2, context=300)
    reading = seat(4, reading=True, unread=5000, rounds=0, side_s=0.1)
    assert plan([mid, short, reading], 0, 8, anything_fits, batching=False) == Plan(alone=(2, 1), side=(4,))
    due = seat(5, rounds=0)  # (its prompt read but for its first round)
    assert plan([mid, short, due], 0, 8, anything_fits, batching=False) == Plan(first=5)


def test_rows_batch_only_while_they_fit_the_memory_budget_padded_to_the_widest():
    seats = [seat(1, context=100), seat(2, context=200), seat(3, context=300)]
    two_rows = lambda rows: len(rows) * max(r.context for r in rows) <= 400  # noqa: E731
    assert plan(seats, 0, 8, two_rows) == Plan(together=(1, 2), side=(3,))
    assert plan(seats, 0, 2, anything_fits) == Plan(together=(1, 2), side=(3,))


def test_a_lone_row_stays_in_the_batch_while_others_start_and_runs_alone_once_none_do():
    row = seat(1, batched=True)
    starting = seat(2, rounds=0)
    assert plan([row, starting], 8, 8, anything_fits) == Plan(together=(1,))
    assert plan([row], 0, 8, anything_fits) == Plan(alone=(1,))
    assert plan([seat(1), seat(2, context=5000)], 0, 8, anything_fits) == Plan(alone=(1, 2))


def test_a_batched_pass_is_as_wide_as_its_rows_copies_pay_for_at_what_each_width_costs():
    prices = BatchPrices()
    assert prices.width([(0, 0.0), (0, 0.0)]) == 1  # no copies: a plain step
    assert prices.width([(4, 0.9), (0, 0.0)]) == 5  # nothing measured, no machine figures: widths are free
    for width, seconds in [(1, 0.10), (2, 0.13), (3, 0.15), (5, 0.50)]:
        prices.record(2, width, seconds)
    assert prices.width([(4, 0.9), (0, 0.0)]) == 3
    assert prices.width([(4, 0.2), (0, 0.0)]) == 1  # copies that seldom land pay for no width
