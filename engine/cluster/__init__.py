"""The engine beyond one machine: replicas on Ray Serve, an ingress, session affinity
(:mod:`engine.cluster.deploy` says how they fit together; ``ray`` is imported only here)."""
