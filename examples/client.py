"""Call `dflash-trt serve` with the openai client: start the server first (`dflash-trt serve --port 8000`), then
`python examples/client.py` (another address: `python examples/client.py http://HOST:PORT/v1`; a server started
with --api-key: `--api-key KEY`). The model name is the server's (`--served-model-name`, default the target
folder's or the bundle's name): read it from GET /v1/models, as here, or pass it as you named it."""

import argparse
import sys

import openai
from openai import OpenAI

parser = argparse.ArgumentParser(description=__doc__.split(":")[0] + ": a chat completion, then a stream.")
parser.add_argument("base_url", nargs="?", default="http://127.0.0.1:8000/v1",
                    help="the server's OpenAI base URL (default: %(default)s)")
parser.add_argument("--api-key", default="unused", help="the key the server was started with (serve --api-key)")
args = parser.parse_args()

client = OpenAI(base_url=args.base_url, api_key=args.api_key)
try:
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is the capital "
                                                                                              "of France?"}],
                                           max_tokens=32, temperature=0)
    print(reply.choices[0].message.content)
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name three "
                                                                                                   "colors."}],
                                                max_tokens=32, temperature=0, stream=True):
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()
except openai.APIConnectionError:
    sys.exit(f"error: no server answers at {args.base_url}; start one (dflash-trt serve --port 8000) or give its "
             "address: python examples/client.py http://HOST:PORT/v1")
except openai.AuthenticationError:
    sys.exit(f"error: the server at {args.base_url} requires its API key: python examples/client.py --api-key KEY")
