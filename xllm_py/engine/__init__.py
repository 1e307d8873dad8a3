"""The engine: the core (requests, scheduler, output processing) and its clients.

engine_core.py, dp_engine_core.py   one replica; a cluster's replicas
core_client.py                      EngineCoreClient, the interface both implement
core_process.py                     the core in a child process, and its client
llm_engine.py                       text in, RequestOutputs out, one step at a time
metrics.py                          the Prometheus metrics the server's /metrics serves
async_engine.py, engine_client.py   the engine on its own thread, as the HTTP layer
                                    sees it (EngineClient)
"""
