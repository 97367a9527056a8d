"""``python -m worker.export_hf``: the built-in model as a Hugging Face checkpoint that transformers loads,
and greedy decoding there gives the tokens our worker process gives."""

import json
import subprocess
import sys

import aiohttp
import pytest
import torch

from tests.worker_process import worker_process
from worker.model.loader import BUILTIN_DIR

transformers = pytest.importorskip("transformers")

KEY = "00112233445566778899aabbccddeeff"
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a Python function that reverses a string."},
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "prefixgate-tiny-hf"
    subprocess.run([sys.executable, "-m", "worker.export_hf", str(out)], check=True, timeout=120)
    return out


def test_export_is_an_ordinary_llama_checkpoint(exported):
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert json.loads((exported / "generation_config.json").read_text())["do_sample"] is False
    # bf16, as trained and shipped: the export is the package's weights byte for byte
    assert (exported / "model.safetensors").read_bytes() == (BUILTIN_DIR / "model.safetensors").read_bytes()
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|end|>"


async def test_transformers_greedy_matches_our_worker(exported, tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, attention_mask=None
        )
    expected = output[0, len(prompt) :].tolist()
    assert len(expected) >= 8  # a real answer, not an immediate EOS

    payload = {
        "request_id": "export-1",
        "prompt_token_ids": prompt,
        "namespace": [{"start_token": 0, "namespace_id": "t-a", "key": KEY}],
        "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0},
        "cache": False,
    }
    log = tmp_path / "worker.log"
    args = ("--model", str(exported), "--num-blocks", "80", "--max-model-len", "1024")
    with worker_process(*args, log_path=log) as url:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async with s.post(f"{url}/v1/tokenize", json={"text": text}) as r:
                assert (await r.json())["token_ids"] == prompt  # same tokenizer, same template
            async with s.post(f"{url}/v1/generate", json=payload) as r:
                assert r.status == 200, await r.text()
                ours = await r.json()
    eos = set(tokenizer.convert_tokens_to_ids(["<|end|>"]))
    assert [t for t in ours["token_ids"] if t not in eos] == [t for t in expected if t not in eos]
    assert ours["text"] == tokenizer.decode(expected, skip_special_tokens=True)
