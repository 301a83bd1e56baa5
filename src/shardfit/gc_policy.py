"""When Python's cyclic garbage collector runs in a `shardfit` process.

Importing torch, transformers and peft and building a model create a few million objects that live as long as the
process. Python's default collector walks all of them on every full collection: about 0.6 s of a 3.7 s start-up on
a 2-core CPU, and once more (about 1 s) in the interpreter's last collection at exit. Almost none is garbage.
So the process entry turns the collector off for start-up (`process_entry`), a command that then runs for long
(training, a chat, a server) collects once, moves everything left out of the collector's sight and turns it back
on (`end_of_startup`), and the exit skips the last walk. A command run in-process (tests, notebooks) keeps Python's
default: these functions change nothing there.
"""

from __future__ import annotations

import gc
from collections.abc import Callable


def process_entry(main: Callable[[], int]) -> int:
    """Run `main` as the whole process: no collections during start-up, none of the start-up objects at exit."""
    gc.disable()
    try:
        return main()
    finally:
        # The interpreter's final collection would walk every object torch and transformers made; the process
        # ends here, so nothing it could free matters.
        gc.freeze()


def end_of_startup() -> None:
    """Objects made so far stay out of later collections; cycles made from here on are collected as usual.

    Only under `process_entry` (the collector off): a caller that kept Python's default keeps it."""
    if not gc.isenabled():
        # Start-up's own cycles (a model load makes some, and one may hold a tensor) go first: a frozen object is
        # never freed. One walk, about 0.3 s here, instead of one per collection threshold during the imports.
        gc.collect()
        gc.freeze()
        gc.enable()
