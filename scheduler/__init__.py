"""Pure-Python scheduling: requests, the KV block allocator, policies, and the asyncio iteration loop.

Never imports torch: the loop is handed a runner (engine.contract.ModelRunner) and exchanges plain
batch descriptions and token ids with it.
"""
