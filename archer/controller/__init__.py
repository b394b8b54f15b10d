"""The driver's side of a run over several ranks (the single controller): the worker groups that call one
worker per rank (in this process at world 1, one Ray actor per rank otherwise) and collect the ranks' results
as each worker method declares (archer/workers/dispatch.py).

Nothing here imports Ray at import time; the Ray worker group imports it when a run asks for world > 1.
"""
