"""The engine beyond one machine: replicas on Ray Serve, an ingress, session affinity
(:mod:`engine.cluster.deploy` says how they fit together; ``ray`` is imported only here)."""

APP_NAME, ENGINE = "specchat", "engine"  # the Serve application and its engine deployment
# What an answer says when the replica writing it dies (the load benchmark counts these apart).
REPLICA_LOST = "the server replica writing this answer stopped; send the message again to continue on another"
