"""Online serving: an OpenAI-compatible HTTP server over the continuous-batching engine
(optimized/executor/engine.py). protocol: request parsing and errors; text: detokenizing and stop strings;
driver: the engine's thread; metrics: Prometheus text; state: the application state the routes share; routes/: one
module per route family; generation: the request loop both generating routes share; app: the wiring; listen and
http_server: the socket bound before the model loads and uvicorn on it, with its read timeouts."""
