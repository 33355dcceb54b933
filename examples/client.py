"""Call `dflash-trt serve` with the openai client: start the server first (`dflash-trt serve --port 8000`), then
`python examples/client.py` (another address: `python examples/client.py http://HOST:PORT/v1`). The model name is the server's (`--served-model-name`, default the target folder's or
the bundle's name): read it from GET /v1/models, as here, or pass it as you named it."""

import sys

from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1", api_key="unused")  # serve --api-key KEY: api_key=KEY
model = client.models.list().data[0].id
reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is the capital of "
                                                                                          "France?"}],
                                       max_tokens=32, temperature=0)
print(reply.choices[0].message.content)
for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name three colors."}],
                                            max_tokens=32, temperature=0, stream=True):
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
