"""The classroom server: one run queue for every browser session (`server.queue`), its settings
(`server.settings`). Torch-free; the engine is imported by the queue's runner only."""
