r"""Writes the example JSONL task next to this file (keyword_train.jsonl, keyword_test.jsonl).

    python configs/examples/make_keyword_data.py

Each record asks for a short line that uses a word, with two extra fields for the rewards of
my_reward.py: `keyword` (the word) and `target_length` (the length of a correct line). The
demonstrator is imperfect, as in the arithmetic task: 40% of the training answers use another
word (drawn afresh for each of a prompt's copies), so the SFT policy includes the keyword only
part of the time and the keyword reward has room to improve it. The test split holds out one prompt template per word (its answers are the
correct ones, for reference; the rewards do not read them).
"""
import json
import os
import random

WORDS = ("cat", "dog", "sun", "moon", "tree", "fish", "bird", "rain", "star", "lake", "frog",
         "rose", "wolf", "snow", "leaf", "ship", "bell", "cake", "corn", "deer", "goat", "kite",
         "lamp", "nest", "owl", "pear", "ring", "seed", "tent", "wind")
PROMPTS = ("use {w}:", "say {w}:", "line with {w}:", "about {w}:")
ANSWERS = ("a {w} sat.", "my {w} ran.", "the {w} is red.", "one {w} hid.")
ERROR_RATE = 0.4


def records(seed: int = 0, copies: int = 4):
  """(train, test) lists of dicts. Each training prompt appears `copies` times with answers
  drawn afresh, so the SFT policy learns the demonstrator's distribution (right ~60% of the
  time) rather than memorising one answer per prompt, and its k samples differ: RLOO's
  advantages are zero when every sample of a prompt gets the same reward."""
  rng = random.Random(seed)
  train, test = [], []
  for i, word in enumerate(WORDS):
    held_out = i % len(PROMPTS)  # each template is held out for some words
    for j, template in enumerate(PROMPTS):
      prompt = template.format(w=word)
      if j == held_out:
        answer = ANSWERS[(i + j) % len(ANSWERS)].format(w=word)
        test.append(dict(prompt=prompt, answer=answer, keyword=word, target_length=len(answer)))
        continue
      for _ in range(copies):
        answer = rng.choice(ANSWERS).format(w=word)
        target_length = len(answer)
        if rng.random() < ERROR_RATE:  # the demonstrator writes about another word
          answer = answer.replace(word, rng.choice([w for w in WORDS if w != word]), 1)
        train.append(dict(prompt=prompt, answer=answer, keyword=word,
                          target_length=target_length))
  return train, test


def main():
  here = os.path.dirname(os.path.abspath(__file__))
  for name, rows in zip(("keyword_train.jsonl", "keyword_test.jsonl"), records()):
    with open(os.path.join(here, name), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {len(rows)} records to {os.path.join(here, name)}")


if __name__ == "__main__":
  main()
