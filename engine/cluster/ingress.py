"""The cluster's front door: one process serving the web page and the OpenAI API (the ASGI app
``web(engine)`` builds, so that the engine never imports the UI) over the engine replicas."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ray.serve._private.http_util import ASGIAppReplicaWrapper  # how Ray's own GradioIngress wraps an app
from ray.serve.handle import DeploymentHandle

from engine.cluster.remote import RemoteEngine
from engine.core.modes import MODES
from engine.interface import EngineClient
from engine.loading import Loading


class Ingress(ASGIAppReplicaWrapper):
    def __init__(self, replicas: DeploymentHandle, web: Callable[[EngineClient], Any]) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

        def remote() -> EngineClient:
            logging.getLogger("specchat.cluster").info("waiting for an engine replica to load its models")
            return RemoteEngine(replicas)

        super().__init__(web(waiting_engine(remote)))


def waiting_engine(load: Callable[[], EngineClient]) -> Loading:
    """The remote engine as the page shows it while the first replica loads."""
    return Loading(load, tuple(MODES), progress_logger="specchat.cluster")
