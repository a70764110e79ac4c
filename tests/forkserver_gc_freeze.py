"""Imported last by the worlds' fork server (tests/worlds.py ``_PRELOAD``): every object the preloaded
imports made moves to the collector's permanent generation before any rank is forked.

Why: a rank inherits torch's and the frameworks' module objects, hundreds of thousands of them, and
every full collection walks them all. Megatron's distributed optimizer calls ``gc.collect()`` twice
in every ``sharded_state_dict`` (its save and its load), which took 1.2 s a call in a Megatron rank.
Frozen objects are never collected (they live as long as the rank anyway) and are no longer walked;
it also spares the pages they sit on the collector's writes, so forked ranks keep sharing them.
"""

import gc

gc.collect()
gc.freeze()
