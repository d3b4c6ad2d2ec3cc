"""The demo's last step: the KB answered through `kdn serve` with the official openai client.

`ask(urls, kb, question)` streams one answer through the URL that picks the caller's nearest
region and asks for a plain one through each region's own URL, printing the text, where it
was answered and how many prompt tokens' KV came from KDN (usage.prompt_tokens_details.
cached_tokens). `run(network, kb, question, say)` deploys the service for the demo, asks,
and stops the service again.
"""
import time

from kdn.engines.transformers.model import MODEL_NAME


def ask(info: dict, kb: str, question: str, say, api_key: str = "kdn", max_tokens: int = 24) -> dict:
    """Ask through the service described by info (kdn.serve.app.service_info); returns
    {"streamed": text, "regions": {region: text}, "cached_tokens": n}."""
    import openai
    model = f"{MODEL_NAME}@{kb}"
    messages = [{"role": "user", "content": question}]
    client = openai.OpenAI(base_url=info["url"], api_key=api_key, max_retries=0, timeout=300)
    t0 = time.perf_counter()
    first, pieces, use = None, [], None
    for c in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                            stream=True, stream_options={"include_usage": True}):
        if c.choices and c.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            pieces.append(c.choices[0].delta.content)
        use = c.usage or use
    streamed = "".join(pieces).strip()
    say(f"      openai client, streamed from {info['url']}: {streamed!r}")
    say(f"      first token after {first * 1000:.0f} ms; {use.prompt_tokens_details.cached_tokens} of "
        f"{use.prompt_tokens} prompt tokens' KV came from KDN")
    regions = {}
    for region, url in info["regions"].items():
        r = openai.OpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=300).chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens)
        regions[region] = r.choices[0].message.content.strip()
        say(f"      {region} ({url}): {regions[region]!r}")
    return {"streamed": streamed, "regions": regions, "cached_tokens": use.prompt_tokens_details.cached_tokens}


def run(network: str, kb: str, question: str, say, **deploy_options) -> dict:
    """Deploy the service on the demo's network, ask through it, stop it."""
    from kdn.serve import app as serve
    from kdn.launch.cluster import free_ports
    t0 = time.perf_counter()
    info = serve.deploy(network, port=deploy_options.pop("port", free_ports(1)[0]), **deploy_options)
    say(f"      service up in {time.perf_counter() - t0:.0f} s (a replica per region, each loading the model)")
    try:
        return ask(info, kb, question, say)
    finally:
        serve.undeploy(network)
