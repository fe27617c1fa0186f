"""Scale-out on Ray: data-parallel engine replicas behind one front end (docs/replicas.md).

replica.py: the actor owning one engine core; owners.py: who owns each request, with
tombstones; router.py: where a new request goes; cores.py: the engine backend that ties them
together for the unchanged AsyncEngine and OpenAI app.
"""
