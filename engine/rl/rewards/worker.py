"""One scoring worker process of engine.rl.rewards.pool: ``python -m engine.rl.rewards.worker
READ_FD WRITE_FD``.

It is a fresh interpreter (never a fork of the trainer, whose torch threads a fork would
copy in a broken state) that imports only the reward function. Protocol, pickled messages on
two pipes (multiprocessing.connection framing):

- in: ``(sys_path, fn_bytes)`` once, then ``(index, item)`` per call; EOF ends the worker;
- out: ``("ready", None, None)`` once the function is loaded (or ``("fatal", None, reason)``
  and exit), then per call ``("ok", index, score)`` or ``("error", index, repr(exception))``.

Each call runs in the main thread, so a function's own ``signal.alarm`` timeouts
(math-verify's) work.
"""
from __future__ import annotations

import pickle
import sys
from multiprocessing.connection import Connection

from engine.rl.rewards.scoring import call_reward


def serve(inbox: Connection, outbox: Connection) -> None:
    """Load the function from the first message, then score items until EOF."""
    sys_path, fn_bytes = inbox.recv()
    sys.path[:] = list(dict.fromkeys(sys_path + sys.path))
    try:
        fn = pickle.loads(fn_bytes)
    except Exception as exc:  # the user's module may fail to import here
        outbox.send(("fatal", None, f"cannot load the reward function: {exc!r}"))
        return
    outbox.send(("ready", None, None))
    while True:
        try:
            index, item = inbox.recv()
        except EOFError:
            return
        try:
            outbox.send(("ok", index, call_reward(fn, item)))
        except Exception as exc:  # a user function may raise anything
            outbox.send(("error", index, repr(exc)))


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]),
                                                                     readable=False))
