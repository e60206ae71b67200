"""quickdraft on Ray Serve: N engine replicas behind one OpenAI-compatible ingress.

calls.py    what crosses between ingress and replica (plain pickled dataclasses)
replica.py  EngineReplica: one process, one Engine; streams RequestOutputs, reports load
router.py   PrefixAffinityRouter: Ray Serve request router, rendezvous hashing on the route key
            with load-aware spill-over
ingress.py  RayBackend (server/backend.py's Backend over a DeploymentHandle) and the Ingress
            deployment that serves the unchanged FastAPI app (server/app.py)
deploy.py   ClusterOptions -> a Serve application; `quickdraft serve --replicas N` runs it

Ray is optional (`pip install quickdraft[cluster]`); nothing outside this package imports it,
and this package's modules import it only where they are used.
"""
