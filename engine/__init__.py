"""torch runtime: KV cache, model runner, sampler. No asyncio, no HTTP.

This package's __init__ stays free of torch imports so that `scheduler` can import the batch contract
(`engine.contract`) without pulling torch in.
"""
