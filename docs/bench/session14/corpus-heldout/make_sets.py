import json, random
from dflash_trt.training.prompts import CHAT_TEMPLATES, TOPICS, MORE_TOPICS, code_corpus, package_dir
new_topics = ["tigers", "the Eiffel Tower", "lighthouses", "submarines", "kites", "snowflakes", "mushrooms",
 "bicycles repair", "tattoos", "jellyfish", "volleyball", "the Amazon river", "umbrellas", "clocks", "bamboo",
 "honey", "the Sahara", "skateboarding", "chess openings", "paper making"]
assert not set(new_topics) & set(TOPICS + MORE_TOPICS)
rng = random.Random(1)
chat = [rng.choice(CHAT_TEMPLATES).format(t=t) for t in new_topics]
code = []
for pkg in ("pydantic", "starlette", "httpx", "prometheus_client", "openai", "anyio", "fastapi", "uvicorn"):
    d = package_dir(pkg)
    if d: code += code_corpus(stdlib=d)
rng.shuffle(code)
print(len(code))
json.dump({"corpus-chat": chat, "corpus-code": code[:20]}, open("/work/scratch/s14/sets.json", "w"), indent=1)
