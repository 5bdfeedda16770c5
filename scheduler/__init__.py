"""Pure-Python scheduling: requests, the KV block allocator, policies, and the asyncio iteration loop.

Never imports torch: the loop is handed an executor (engine.contract.Executor) and exchanges plain
batch descriptions and token ids with it.
"""
