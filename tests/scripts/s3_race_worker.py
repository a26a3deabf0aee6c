"""A writer process for the racing-writers tests: saves what it is told, pausing before the commit.

Reads one JSON command per line on stdin: ``{"url": REPO/NAME, "writer": i, "seed": s,
"options": storage_options}``. Saves ``race_state(writer, seed)``; once its chunks
are durable it writes ``{"ready": true}`` and waits for a ``go`` line, so the
parent can release two writers into the commit together. Then it writes
``{"outcome": "committed"}`` or ``{"outcome": "error", "type": ..., "message": ...}``.
Protocol lines start with ``@@ `` on the real stdout; anything else a library prints goes to stderr.
"""

from __future__ import annotations

import json
import sys

from tests.support.races import race_state


def main() -> None:
    import ckptfmt

    channel = sys.stdout
    sys.stdout = sys.stderr

    def send(message: dict) -> None:
        channel.write("@@ " + json.dumps(message) + "\n")
        channel.flush()

    def wait_for_go() -> None:
        send({"ready": True})
        if sys.stdin.readline().strip() != "go":
            raise SystemExit("no go")

    send({"started": True})
    for line in sys.stdin:
        command = json.loads(line)
        try:
            ckptfmt.save(race_state(command["writer"], command["seed"]), command["url"], parent=None,
                         storage_options=command["options"], before_commit=wait_for_go)
            send({"outcome": "committed"})
        except Exception as exc:
            send({"outcome": "error", "type": type(exc).__name__, "message": str(exc),
                  "exists": isinstance(exc, ckptfmt.CheckpointExistsError)})


if __name__ == "__main__":
    main()
