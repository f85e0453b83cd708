#!/usr/bin/env python
"""Regenerate every committed asset of rlhf_core (deterministic).

Writes, relative to the repository root:

* ``rlhf_core/assets/data/synthetic/*.jsonl`` - the bundled synthetic task
  (``rlhf_core.data.synthetic.generate``, seed 0);
* ``rlhf_core/assets/corpus.txt`` - tokenizer training text: the synthetic
  prompts and responses (deduplicated) plus generic English sentences so that
  common words, digits and punctuation are covered;
* ``rlhf_core/assets/tokenizer/`` - a byte-level BPE tokenizer (vocab 1024)
  trained on the corpus with the ``tokenizers`` library and saved as a
  ``transformers.PreTrainedTokenizerFast`` with a chat template.

Run: ``python scripts/build_assets.py`` (add ``--check`` to verify the result).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlhf_core.data import synthetic  # noqa: E402

ASSETS = ROOT / "rlhf_core" / "assets"
DATA_DIR = ASSETS / "data" / "synthetic"
CORPUS = ASSETS / "corpus.txt"
TOKENIZER_DIR = ASSETS / "tokenizer"

VOCAB_SIZE = 1024
PAD, BOS, EOS, USER, ASSISTANT = "<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, USER, ASSISTANT]

# user turn:      <|user|>{content}\n
# assistant turn: <|assistant|>{content}<|eos|>\n
# generation prompt: a trailing <|assistant|>
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{ '<|user|>' + message['content'] + '\n' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '<|assistant|>' + message['content'] + '<|eos|>' + '\n' }}"
    "{%- else -%}"
    "{{ raise_exception('unsupported chat role: ' + message['role'] + \" (expected 'user' or 'assistant')\") }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|assistant|>' }}"
    "{%- endif -%}"
)

# Hand-written generic English: common words, questions, digits, punctuation.
GENERIC_SENTENCES = """\
Hello, how are you today?
I am fine, thank you. And you?
What time is it? It's almost 3:30 in the afternoon.
Please write a short answer in one sentence.
The quick brown fox jumps over the lazy dog.
She said, "Let's meet at the station at 9 o'clock."
We bought 12 apples, 4 pears and 1 melon for $7.50.
Can you help me with my homework, please?
Yes! That's exactly what I meant.
No, I don't think that's a good idea.
Why is the sky blue? Because of the way light scatters.
There are 365 days in a year and 24 hours in a day.
He couldn't find his keys, so he stayed home.
They're going to the park; we're staying inside.
Is this the right way to the library?
The meeting starts at 10:00 a.m. on Monday (not Tuesday).
Thank you for your message - I'll reply soon.
Here is a list: one, two, three, four, five.
My favorite colors are red, green and blue.
It was a long day, but everything worked out in the end.
Could you explain that again, more slowly?
The children were playing in the yard when it started to rain.
I've read this book twice and I still like it.
Do you know where the nearest shop is?
Turn left at the corner, then walk straight for 200 meters.
Water boils at 100 degrees Celsius at sea level.
Who wrote this letter? I don't recognize the name.
We should leave early to avoid the traffic.
Our team won the game 3-1 last night!
Please answer with yes or no.
The answer is 42.
Summer is warm, winter is cold, and spring is somewhere in between.
"Good morning," said the teacher to the class.
If it rains tomorrow, we'll stay at home and read.
The store opens at 8 and closes at 18:00.
I would like a cup of tea with milk, please.
Everyone was happy to see the sun again after the storm.
The train was late, so we missed the first part of the movie.
What do you think about this plan?
Let me know if you have any questions.
This is an example of a simple sentence.
A user asks a question and the assistant gives an answer.
Write a sentence about your day.
Tell me something interesting about the ocean.
The assistant should be helpful, honest and kind.
Sometimes the best answer is a short one.
Numbers like 0, 1, 2, 3, 4, 5, 6, 7, 8 and 9 are digits.
The price went up by 5% this year.
She has two brothers and one sister.
It's not about winning; it's about taking part.
We walked along the river until the sun went down.
The old man smiled and waved at us.
I'm sorry, I didn't understand your question.
Could you give me an example?
They live in a small house near the mountains.
Reading every day is a good habit.
The cat slept on the warm windowsill all afternoon.
My phone number is 555-0123, call me anytime.
The recipe needs 2 eggs, 1 cup of flour and a pinch of salt.
First, open the box. Second, read the instructions. Third, enjoy!
Where did you put the map?
Life is full of surprises, isn't it?
The weather today is sunny with a light breeze.
He works at a hospital in the city center.
Don't forget to bring an umbrella.
That was the best concert I have ever been to!
Be careful: the floor is wet.
The museum is closed on public holidays.
What's your name? My name is Sam.
I can't wait for the weekend.
"""

_SUBJECTS = (
    "I",
    "You",
    "We",
    "They",
    "He",
    "She",
    "My friend",
    "The teacher",
    "Our neighbor",
    "The children",
    "Everyone",
    "Nobody",
)
_VERBS = (
    "like",
    "see",
    "visit",
    "remember",
    "love",
    "watch",
    "find",
    "need",
    "want",
    "know",
    "hear about",
    "talk about",
)
_TIMES = (
    "today",
    "yesterday",
    "every day",
    "on Sunday",
    "in the morning",
    "at night",
    "last week",
    "this year",
    "sometimes",
    "again",
)
_QUESTIONS = (
    "What do you think about the {t}?",
    "Have you ever seen the {t}?",
    "Where is the {t}?",
    "Why do people like the {t}?",
    "Is the {t} {a} today?",
    "How was the {t} {w}?",
)
_CONNECT = ("and", "but", "so", "because", "although", "while")


def _generated_sentences(rng: random.Random, n: int) -> list[str]:
    """Simple generic sentences built from the task's word lists."""
    adjectives = synthetic.POSITIVE + synthetic.NEGATIVE
    out = []
    for i in range(n):
        t = rng.choice(synthetic.TOPICS)
        a = rng.choice(adjectives)
        w = rng.choice(_TIMES)
        kind = i % 4
        if kind == 0:
            s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} the {t} {w}."
        elif kind == 1:
            s = rng.choice(_QUESTIONS).format(t=t, a=a, w=w)
        elif kind == 2:
            s = (
                f"The {t} was {a} {w}, {rng.choice(_CONNECT)} the "
                f"{rng.choice(synthetic.TOPICS)} was {rng.choice(adjectives)}."
            )
        else:
            s = f"{rng.randint(1, 99)} people said the {t} is {a}!"
        out.append(s)
    return out


def write_data(seed: int = 0) -> dict[str, Path]:
    if DATA_DIR.exists():
        shutil.rmtree(DATA_DIR)
    return synthetic.generate(DATA_DIR, seed=seed)


def build_corpus(paths: dict[str, Path], n_generated: int = 400, max_rows_per_split: int = 1000) -> list[str]:
    """Deduplicated synthetic texts (first-seen order) plus generic English."""
    lines: list[str] = []
    seen: set[str] = set()

    def add(text: str) -> None:
        text = text.strip()
        if text and text not in seen:
            seen.add(text)
            lines.append(text)

    for template in synthetic.TEMPLATES:
        for topic in synthetic.TOPICS:
            add(template.format(topic=topic))
    # A sample of responses is enough (the task has ~140 distinct words) and
    # keeps the committed corpus small.
    for name, keys in (("sft_train", ("output",)), ("pref_train", ("chosen", "rejected"))):
        with open(paths[name], encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i >= max_rows_per_split:
                    break
                row = json.loads(line)
                for key in keys:
                    add(row[key])
    for s in GENERIC_SENTENCES.splitlines():
        add(s)
    for s in _generated_sentences(random.Random(0), n_generated):
        add(s)
    return lines


def train_tokenizer(lines: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS}:1 $B:1",
        special_tokens=[(BOS, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        extra_special_tokens=[USER, ASSISTANT],
        model_max_length=1024,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def save_tokenizer(hf_tok) -> None:
    if TOKENIZER_DIR.exists():
        shutil.rmtree(TOKENIZER_DIR)
    hf_tok.save_pretrained(str(TOKENIZER_DIR))


def check(lines: list[str]) -> dict:
    """Reload offline and verify round trip, specials, chat template, lengths."""
    import os
    import statistics

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    assert len(tok) == VOCAB_SIZE, len(tok)
    assert tok.pad_token_id != tok.eos_token_id
    assert set(tok.all_special_ids) == set(range(len(SPECIAL_TOKENS))), tok.all_special_ids
    for line in lines:
        ids = tok(line)["input_ids"]
        assert ids[0] == tok.bos_token_id, line
        back = tok.decode(ids, skip_special_tokens=True)
        assert back == line, (line, back)
    msgs = [
        {"role": "user", "content": "Write a sentence about the garden."},
        {"role": "assistant", "content": "The garden is good."},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == ("<|user|>Write a sentence about the garden.\n<|assistant|>The garden is good.<|eos|>\n"), repr(
        text
    )
    gen = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert gen.endswith("\n<|assistant|>"), repr(gen)

    rows = [json.loads(line) for line in (DATA_DIR / "sft_train.jsonl").read_text(encoding="utf-8").splitlines()]
    p_len = [len(tok(r["input"], add_special_tokens=False)["input_ids"]) for r in rows]
    r_len = [len(tok(r["output"], add_special_tokens=False)["input_ids"]) for r in rows]
    full = [
        len(
            tok(
                tok.apply_chat_template(
                    [{"role": "user", "content": r["input"]}, {"role": "assistant", "content": r["output"]}],
                    tokenize=False,
                )
            )["input_ids"]
        )
        for r in rows
    ]
    assert max(full) < 64, max(full)
    stats = {
        "vocab_size": len(tok),
        "special_ids": {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS},
        "prompt_tokens(mean/max)": (round(statistics.mean(p_len), 1), max(p_len)),
        "response_tokens(mean/max)": (round(statistics.mean(r_len), 1), max(r_len)),
        "chat_formatted_with_bos(mean/max)": (round(statistics.mean(full), 1), max(full)),
    }
    return stats


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify the written tokenizer")
    args = parser.parse_args(argv)

    paths = write_data(seed=0)
    lines = build_corpus(paths)
    CORPUS.write_text("\n".join(lines) + "\n", encoding="utf-8")
    save_tokenizer(train_tokenizer(lines))

    print(f"data:      {DATA_DIR.relative_to(ROOT)} ({_size(DATA_DIR)} bytes)")
    print(f"corpus:    {CORPUS.relative_to(ROOT)} ({len(lines)} lines, {_size(CORPUS)} bytes)")
    print(f"tokenizer: {TOKENIZER_DIR.relative_to(ROOT)} ({_size(TOKENIZER_DIR)} bytes)")
    print(f"total:     {_size(DATA_DIR) + _size(CORPUS) + _size(TOKENIZER_DIR)} bytes")
    if args.check:
        for k, v in check(lines).items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
