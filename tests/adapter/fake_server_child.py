"""A FakeAnthropicServer in a process of its own (run as a script, not collected).

``python fake_server_child.py N``: serve N text replies (10 input and 2 output
tokens each), print the server's URL, and when standard input ends print the
requests received and the input tokens served. In its own process the
server's threads do not share the event loop's interpreter lock, so a load
test measures the client, not the witness.
"""

from __future__ import annotations

import sys

from loopengine import Usage
from loopengine.testing import FakeAnthropicServer, Reply

if __name__ == "__main__":
    count = int(sys.argv[1])
    script = [Reply.text(f"answer {n}", usage=Usage(input_tokens=10, output_tokens=2))
              for n in range(count)]
    with FakeAnthropicServer(script) as server:
        print(server.url, flush=True)
        sys.stdin.read()
        print(len(server.requests), server.usage_served.input_tokens, flush=True)
