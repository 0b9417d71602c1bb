"""Writes the slogan task rows (data/slogan/{train,heldout}.jsonl); held-out words never occur in
training rows, so the held-out metric measures the skill, not memorized words.

    python scripts/make_slogan_tasks.py
"""

import json
import random
from pathlib import Path

TOPICS = (
    "a bakery, a bike shop, a library, a city park, a coffee cart, a recycling drive, a school fair, "
    "a music festival, a farmers market, a swimming pool, a science museum, a bookshop, a tea house, "
    "a flower shop, a dog shelter, a night train, a mountain hut, a food truck, a chess club, a zoo"
).split(", ")
WORDS = (
    "bright fresh green golden happy quick warm bold calm clever friendly gentle honest lively "
    "proud quiet shiny simple smart strong sunny sweet wild young brave cheerful cozy crisp eager "
    "fancy fast fair grand kind loyal merry neat noble open pure rich safe smooth soft steady "
    "tasty tidy true vivid wise busy cool daily easy free local modern new playful "
    "river garden sky morning summer winter spring autumn forest ocean mountain rainbow star "
    "moon sun light music dream smile heart friend family home journey adventure future world "
    "city road bridge harbor island meadow valley village window door table chair lamp book"
).split()


def main(out_dir: str = "data/slogan", seed: int = 0) -> None:
    rng = random.Random(seed)
    words = sorted(set(WORDS))
    rng.shuffle(words)
    heldout_words, train_words = words[:24], words[24:]
    splits = {"train": (train_words, 400), "heldout": (heldout_words, 32)}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for name, (pool, count) in splits.items():
        with open(Path(out_dir) / f"{name}.jsonl", "w") as f:
            for i in range(count):
                word0, word1 = rng.sample(pool, 2)
                row = {"id": f"{name}-{i}", "topic": rng.choice(TOPICS), "word0": word0, "word1": word1}
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
