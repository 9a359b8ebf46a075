"""Drives a running shoal node with the official OpenAI Python SDK, as an app would.

Usage: openai_client.py BASE_URL MODEL CONTEXT
Prints one JSON object with what each scenario saw; tests/api.rs makes the assertions. It
checks nothing itself beyond what the SDK does (parsing SSE and typed errors), so a failure
shows up as data in the report, not as a Python traceback, whenever possible.
"""

import json
import sys

import openai

base_url, model, context = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=240)
messages = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": [{"type": "text", "text": "Name three primary colours."}]},
]
greedy = dict(model=model, messages=messages, max_tokens=12, temperature=0, seed=7)
report = {}

whole = client.chat.completions.create(**greedy)
report["chat"] = {
    "text": whole.choices[0].message.content,
    "role": whole.choices[0].message.role,
    "finish_reason": whole.choices[0].finish_reason,
    "usage": whole.usage.model_dump(),
    "object": whole.object,
    "model": whole.model,
    "shoal": (whole.model_extra or {}).get("shoal"),
}

pieces, chunks, finish, usage_chunk, roles = [], 0, None, None, []
for chunk in client.chat.completions.create(**greedy, stream=True, stream_options={"include_usage": True}):
    chunks += 1
    if chunk.usage is not None:
        usage_chunk = {"usage": chunk.usage.model_dump(), "choices": len(chunk.choices)}
    for choice in chunk.choices:
        if choice.delta.role:
            roles.append(choice.delta.role)
        if choice.delta.content:
            pieces.append(choice.delta.content)
        if choice.finish_reason:
            finish = choice.finish_reason
report["chat_stream"] = {"text": "".join(pieces), "chunks": chunks, "finish_reason": finish, "usage_chunk": usage_chunk, "roles": roles}

completion = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=10, temperature=0)
streamed = "".join(c.choices[0].text for c in client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=10, temperature=0, stream=True) if c.choices)
report["completion"] = {"text": completion.choices[0].text, "streamed": streamed, "usage": completion.usage.model_dump(), "object": completion.object}

report["models"] = [{"id": m.id, "loaded": (m.model_extra or {}).get("shoal", {}).get("loaded")} for m in client.models.list().data]


def error_of(call):
    try:
        call()
        return None
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        return {"status": e.status_code, "code": body.get("code"), "param": body.get("param"), "message": body.get("message"), "class": type(e).__name__}


report["errors"] = {
    "unknown_model": error_of(lambda: client.chat.completions.create(**{**greedy, "model": "no-such-model"})),
    "n2": error_of(lambda: client.chat.completions.create(**greedy, n=2)),
    "logprobs": error_of(lambda: client.chat.completions.create(**greedy, logprobs=True)),
    "too_long": error_of(lambda: client.chat.completions.create(**{**greedy, "messages": [{"role": "user", "content": "word " * (context + 10)}]})),
    "too_long_stream": error_of(lambda: list(client.chat.completions.create(**{**greedy, "messages": [{"role": "user", "content": "word " * (context + 10)}]}, stream=True))),
}
print(json.dumps(report))
