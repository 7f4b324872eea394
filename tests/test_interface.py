"""The engine interface the front ends are written against: the in-process engine and its loading
placeholder offer it (mypy checks this file too, so the check is also static; the cluster's
remote engine is checked where the ingress creates it, engine/cluster/ingress.py)."""

from __future__ import annotations

from engine.core.service import Engine
from engine.interface import EngineClient
from engine.loading import Loading


def test_the_engine_and_its_loading_placeholder_offer_the_interface(engine: Engine) -> None:
    offered: list[EngineClient] = [engine, Loading(lambda: engine, engine.modes)]
    assert all(isinstance(e, EngineClient) for e in offered)
