"""Online serving: an OpenAI-compatible HTTP server over the continuous-batching engine
(optimized/executor/engine.py). protocol: request parsing and errors; text: detokenizing and stop strings;
driver: the engine's thread; metrics: Prometheus text; app: the FastAPI routes."""
