"""The ``hexgen-flow`` command line: the top layer, over the core and the client.

``simulate``, ``tune``, ``policies`` (`hexgen_cli.simulation`) and ``bench``
(`hexgen_cli.bench`) run on the scheduling core alone; ``up``, ``replay``, ``ask``,
``status`` (`hexgen_cli.mesh`) and ``demo`` (`hexgen_cli.demo`) drive the service mesh
through the Python client, which they import only when they run, so that the simulator
commands never load grpc or redis and work with the core alone (``pip install
hexgen-flow``; the mesh commands need ``hexgen-flow[mesh]``).

Output contract:

- ``--json`` prints exactly one JSON object on stdout (one line); progress and information
  go to stderr. Non-finite numbers are written as ``null``.
- Bad input (missing or malformed trace, unknown policy/GPU/model, bad option value) exits
  with code 2 and one line on stderr, ``hexgen-flow: error: ...``; never a traceback.
- Ctrl-C exits with code 130 without a traceback (``up`` and ``demo`` stop their processes
  first; ``up`` then exits with 0).
- A coordinator that does not answer: ``hexgen-flow: error: cannot reach the coordinator at
  ADDR: is `hexgen-flow up` running?``, exit code 2.
"""

from hexgen_cli.main import build_parser, main

__all__ = ["build_parser", "main"]
