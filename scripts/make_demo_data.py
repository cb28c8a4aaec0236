"""Regenerate fitburst/demo/instructions.jsonl, the demo pipeline's small instruction set (alpaca shape)."""

import json
import random
from pathlib import Path

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "Canada": "Ottawa", "Egypt": "Cairo", "Peru": "Lima", "Kenya": "Nairobi", "Norway": "Oslo",
    "Poland": "Warsaw", "Greece": "Athens", "Chile": "Santiago", "Cuba": "Havana", "Ireland": "Dublin",
    "Portugal": "Lisbon", "Austria": "Vienna", "Sweden": "Stockholm", "Finland": "Helsinki", "India": "New Delhi",
}
OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "up": "down", "happy": "sad", "light": "dark",
    "open": "closed", "early": "late", "strong": "weak", "full": "empty", "old": "new", "high": "low",
}
WORDS = ["apple", "river", "garden", "window", "yellow", "planet", "silver", "forest", "castle", "pencil"]


def records(rng: random.Random) -> list[dict]:
    out = []
    for _ in range(160):
        a, b = rng.randint(1, 60), rng.randint(1, 60)
        out.append({"instruction": f"Add {a} and {b}.", "input": "", "output": f"{a} + {b} = {a + b}."})
    for country, city in CAPITALS.items():
        for q in ("What is the capital of {}?", "Name the capital city of {}.", "Which city is the capital of {}?"):
            answer = f"The capital of {country} is {city}."
            out.append({"instruction": q.format(country), "input": "", "output": answer})
    for word, opp in OPPOSITES.items():
        for q in ("What is the opposite of '{}'?", "Give the antonym of '{}'."):
            out.append({"instruction": q.format(word), "input": "", "output": f"The opposite of {word} is {opp}."})
    for _ in range(80):
        ws = rng.sample(WORDS, 3)
        text = " ".join(ws)
        out.append({"instruction": "Convert the text to upper case.", "input": text, "output": text.upper()})
    for _ in range(60):
        ws = rng.sample(WORDS, 4)
        out.append({"instruction": "Sort these words alphabetically.", "input": ", ".join(ws),
                    "output": ", ".join(sorted(ws))})
    rng.shuffle(out)
    return out


if __name__ == "__main__":
    dest = Path(__file__).resolve().parents[1] / "fitburst" / "demo" / "instructions.jsonl"
    with dest.open("w") as f:
        for r in records(random.Random(0)):
            f.write(json.dumps(r) + "\n")
    print(f"wrote {dest}")
