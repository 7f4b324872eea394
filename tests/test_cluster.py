"""The app on Ray Serve (engine/cluster): settings, affinity keys and routing on their own; then a
real two-node Ray cluster on loopback with the tiny pair: the load benchmark through the page
with a replica killed mid-run, and a replica killed under a streaming answer."""

from __future__ import annotations

import asyncio
import time
from argparse import Namespace
from types import SimpleNamespace

import pytest

from benchmarks import loadtest, scaleout
from benchmarks.chaos import app_server
from engine.cluster import APP_NAME, ENGINE, REPLICA_LOST, local
from engine.cluster.deploy import MIN_THREADS, ClusterSettings
from engine.cluster.remote import RemoteEngine, affinity_key
from engine.cluster.router import AffinityRouter
from engine.core.requests import Event, Request, Stream
from engine.errors import EngineError
from ui.render import render_answer

SETTINGS = ("replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "cpus_per_replica")


def flags(config: str | None = None, **given) -> Namespace:
    return Namespace(cluster_config=config, **{name: given.get(name) for name in SETTINGS})


def test_settings_come_from_flags_over_the_config_file_over_defaults(tmp_path):
    assert ClusterSettings.from_args(flags()).scaling() == {"num_replicas": 2}
    config = tmp_path / "cluster.toml"
    config.write_text("[cluster]\nreplicas = 3\ncpus_per_replica = 4\n")
    settings = ClusterSettings.from_args(flags(str(config), replicas=5))
    assert (settings.replicas, settings.cpus_per_replica, settings.threads) == (5, 4, 4)
    autoscaled = ClusterSettings.from_args(flags(min_replicas=1, max_replicas=4, target_ongoing_requests=2))
    assert autoscaled.scaling() == {
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2}
    }
    assert ClusterSettings.from_args(flags(cpus_per_replica=1)).threads == MIN_THREADS  # (OpenVINO needs two)


@pytest.mark.parametrize(
    ("text", "given", "says"),
    [
        ("[cluster]\nreplica = 2\n", {}, "unknown setting"),
        ("[cluster\n", {}, "cannot read"),
        ("", {"max_replicas": 3}, "both --min-replicas and --max-replicas"),
        ("", {"min_replicas": 4, "max_replicas": 2}, "between 1 and"),
        ("", {"min_replicas": 0, "max_replicas": 2}, "between 1 and"),
        ("", {"replicas": 0}, "must be positive"),
    ],
)
def test_bad_settings_are_refused_with_the_reason(tmp_path, text, given, says):
    config = tmp_path / "cluster.toml"
    config.write_text(text)
    with pytest.raises(EngineError, match=says):
        ClusterSettings.from_args(flags(str(config), **given))


def test_every_turn_of_a_conversation_has_its_opening_key():
    opening = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    later = (*opening, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"})
    assert affinity_key(Request(opening)) == affinity_key(Request(later)) is not None
    assert affinity_key(Request(later, answer_ids=(5, 6))) == affinity_key(Request(opening))  # Continue
    assert affinity_key(Request(({"role": "user", "content": "Bye"},))) != affinity_key(Request(opening))
    assert affinity_key(Request(opening, reuse_cache=False)) is None  # fresh caches: any replica
    assert affinity_key(Request(prompt_ids=tuple(range(80)))) == affinity_key(Request(prompt_ids=tuple(range(90))))


def replica(name: str):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name))


def routed(router: AffinityRouter, key: str | None, candidates: list) -> list[str]:
    pending = SimpleNamespace(kwargs={"affinity": key} if key else {}, routing_context=SimpleNamespace())
    ranks = asyncio.run(router.choose_replicas(candidates, pending))  # type: ignore[arg-type]
    return [r.replica_id.unique_id for rank in ranks for r in rank]


def router() -> AffinityRouter:
    made = AffinityRouter.__new__(AffinityRouter)  # (the routing logic alone, without Ray's plumbing)
    made.initialize_state()
    return made


def test_a_conversation_returns_to_its_replica_and_moves_only_when_it_is_gone():
    a, b, c = replica("a"), replica("b"), replica("c")
    first = router()
    order = routed(first, "conversation-1", [a, b])
    assert sorted(order) == ["a", "b"] and routed(router(), "conversation-1", [b, a]) == order  # ingresses agree
    home = order[1]  # say Ray found the first choice full and took the other
    served = SimpleNamespace(kwargs={"affinity": "conversation-1"})
    first.on_request_routed(served, SimpleNamespace(unique_id=home), None)  # type: ignore[arg-type]
    assert routed(first, "conversation-1", [a, b, c])[0] == home  # a replica added: it stays where it was
    left = [r for r in (a, b, c) if r.replica_id.unique_id != home]
    assert routed(first, "conversation-1", left)[0] != home  # its replica gone: another takes it
    assert routed(first, None, [a, b]) == ["a", "b"]  # no key: Ray's least-loaded choice among all
    homes = [routed(router(), f"conversation-{i}", [a, b])[0] for i in range(200)]
    assert 60 < homes.count("a") < 140  # new conversations spread over the replicas


def answer(user: int, turn: int, replica: str, error: str = "") -> loadtest.Answer:
    return loadtest.Answer(user, turn, text="x", error=error, metrics={"replica": replica, "new_tokens": 4})


CUT = render_answer({"failed": True, "content": REPLICA_LOST}, colour=False)  # as the page shows it


def test_affinity_counts_follow_ups_on_their_replica_unless_it_was_killed():
    answers = [answer(0, 0, "a"), answer(0, 1, "a"), answer(0, 2, "b")]  # one miss of two
    assert loadtest.affinity(answers) == 0.5
    killed = [
        answer(1, 0, "a"),
        answer(1, 1, "a", CUT),
        answer(1, 2, "b"),
        answer(2, 0, "b"),
        answer(2, 1, "b"),
    ]
    assert loadtest.affinity(killed) == 1.0  # moving off a killed replica is not a miss
    assert loadtest.summarize(3, killed, 2.0, {})["killed"] == 1
    assert loadtest.spread(killed, 2.0)["b"] == {"answers": 3, "tokens": 12, "tokens_per_s": 6.0}


# -- on a two-node Ray cluster on loopback, the tiny pair ------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    with local.two_nodes(cpus=1) as address:
        yield address


def tiny_models(hf_target, hf_draft, tiny_cache) -> list[str]:
    models = ["--target", str(hf_target), "--draft", str(hf_draft), "--cache-dir", str(tiny_cache)]
    return [*models, "--target-precision", "fp16", "--draft-precision", "fp16"]


@pytest.mark.cluster
def test_load_through_the_page_with_a_replica_killed_mid_run(
    cluster, ir_target, hf_target, hf_draft, tiny_cache, tmp_path
):
    prompts = tmp_path / "prompts.jsonl"  # short ones: the tiny model's context is 256 tokens
    words = ("cats", "rain", "tea", "bread", "snow", "maps", "bees", "jazz")  # a conversation each
    prompts.write_text("".join(f'{{"prompt": "Tell me about {w}."}}\n' for w in words))
    args = Namespace(users=8, turns=3, prompts=prompts, max_new_tokens=16, kill_after=1.0)
    rows = {r["users"]: r for r in scaleout.measure(cluster, 2, args, tiny_models(hf_target, hf_draft, tiny_cache))}
    killed = rows[8]["killed_replica"]
    for row in rows.values():
        assert row["answers"] == 8 * 3
        empty = [a for a in row["per_answer"] if not a["error"] and not a["tokens"]]
        assert row["errors"] == row["lost"] == row["mixed"] == row["differ"] == 0, (row["failures"], empty)
        assert kept_affinity(row["per_answer"], killed) >= 0.9
    after = [a for a in rows[8]["per_answer"] if a["replica"] and a["replica"] != killed]
    assert killed and after  # the killed replica's conversations went on elsewhere


def kept_affinity(answers: list[dict], killed: str | None) -> float:
    """The share of follow-up turns served where the conversation's turn before was, among those
    whose replica was not the one killed (a request that had not started on it was sent to
    another, uncut, so the load test cannot tell that one from the others)."""
    before = {(a["user"], a["turn"]): a["replica"] for a in answers}
    pairs = [(a["replica"], before.get((a["user"], a["turn"] - 1))) for a in answers if a["turn"] and not a["error"]]
    counted = [now == then for now, then in pairs if then is not None and then != killed]
    return sum(counted) / len(counted)


def last(stream: Stream) -> Event:
    return next(event for event in stream if event.final)


@pytest.mark.cluster
def test_a_killed_replica_ends_its_answer_clearly_and_the_conversation_goes_on(
    cluster, ir_target, hf_target, hf_draft, tiny_cache
):
    from ray import serve

    served = [*tiny_models(hf_target, hf_draft, tiny_cache), "--ray", cluster, "--replicas", "2"]
    with app_server(served), local.connected(cluster):
        engine = RemoteEngine(serve.get_deployment_handle(ENGINE, APP_NAME))
        try:  # (closed even on a failure: its probe would otherwise call a cluster that is being stopped)
            opening = ({"role": "user", "content": "Tell me a long story."},)
            request = Request(opening, mode="autoregressive", max_new_tokens=200, temperature=0.0)
            stream = engine.generate(request)
            first = next(e for e in stream if e.kind == "delta")
            assert engine.pending == 1 and stream.refusal == ""
            local.kill_replica(first.metrics["replica"])
            start = time.monotonic()
            cut = last(stream)
            assert cut.kind == "error" and cut.error == REPLICA_LOST and time.monotonic() - start < 30
            # The next turn of that conversation: another replica prefills it, no error.
            again = last(engine.generate(request))
            assert again.kind == "done" and again.metrics["replica"] != first.metrics["replica"]
            fresh = Request(opening, mode="autoregressive", max_new_tokens=200, reuse_cache=False)
            assert again.token_ids == last(engine.generate(fresh)).token_ids  # as a solo run on fresh caches
            # Ray starts a replica in place of the killed one; the engine's probe sees it within its period.
            deadline = time.monotonic() + 120
            while (len(local.replicas()) < 2 or engine.replicas < 2) and time.monotonic() < deadline:
                time.sleep(1)
            assert len(local.replicas()) == 2 and first.metrics["replica"] not in local.replicas()
            assert engine.healthy and engine.pending == 0 and engine.replicas == 2
            refused = engine.generate(Request(opening, mode="no-such-mode"))
            assert "mode" in refused.refusal and last(refused).kind == "error"  # said by a replica, before any work
        finally:
            engine.close()
