"""Regenerate the demo dataset in src/shardfit/demo/ (deterministic; the output is committed).

Task: turn a free-form sentence about a person into a fixed one-line record, `name=<First Last>; city=<City>;
ext=<4 digits>`. The base model has never seen this exact format and answers in prose; a short LoRA fine-tune
learns it. Held-out examples use first names, last names and cities that never appear in training, so the tuned
model must copy from the sentence, not recall memorised answers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

FIRST = ["Maria", "James", "Aiko", "Liam", "Fatima", "Noah", "Elena", "Omar", "Chloe", "Mateo", "Priya", "Lucas",
         "Hana", "Ethan", "Sofia", "Ivan", "Amara", "Diego", "Nora", "Kenji", "Leila", "Owen", "Zara", "Felix",
         "Ingrid", "Tomas", "Mei", "Hugo", "Anya", "Rafael", "Greta", "Samir", "Lena", "Victor", "Yara", "Oscar"]
LAST = ["Lopez", "Smith", "Tanaka", "Novak", "Haddad", "Brown", "Rossi", "Khan", "Dubois", "Garcia", "Patel",
        "Muller", "Sato", "Walker", "Costa", "Petrov", "Okafor", "Silva", "Berg", "Mori", "Farah", "Evans",
        "Ahmed", "Klein", "Larsen", "Horvat", "Chen", "Laurent", "Ivanova", "Santos", "Fischer", "Nasser"]
CITY = ["Denver", "Lyon", "Osaka", "Porto", "Cairo", "Leeds", "Turin", "Lagos", "Quebec", "Bilbao", "Pune",
        "Graz", "Sendai", "Austin", "Recife", "Kazan", "Accra", "Malmo", "Bergen", "Kyoto", "Tunis", "Cardiff",
        "Dhaka", "Bremen", "Aarhus", "Split", "Wuhan", "Nantes", "Riga", "Santos", "Basel", "Amman"]
HELD_FIRST = ["Beatrix", "Caspian", "Delphine", "Emeka", "Solveig", "Tariq", "Ottilie", "Ruairi", "Xiomara", "Anders"]
HELD_LAST = ["Quiroga", "Vandermeer", "Oyelaran", "Lindqvist", "Abernathy", "Castellano", "Wojcik", "Ferreira"]
HELD_CITY = ["Tromso", "Oaxaca", "Ghent", "Timisoara", "Hobart", "Arequipa", "Kumasi", "Bologna", "Tallinn", "Cusco"]

TEMPLATES = [
    "Please reach {name} at the {city} office, extension {ext}.",
    "{name} from our {city} branch can be called on ext. {ext}.",
    "You can contact {name} ({city}) by dialing extension {ext}.",
    "For billing questions, {name} in {city} answers at extension {ext}.",
    "Our new hire {name} sits in {city}; her desk line is extension {ext}.",
    "Ring extension {ext} to speak with {name}, who works out of {city}.",
    "The {city} team lead is {name}, reachable on extension {ext}.",
    "If the server is down, call {name} in {city} at ext {ext} right away.",
    "Meeting notes: {name} ({city} site) will take calls on extension {ext} this week.",
    "Extension {ext} now forwards to {name} at the {city} location.",
    "Ask the front desk in {city} for {name}, or dial extension {ext}.",
    "{name}, our {city} contact, prefers calls on extension {ext}.",
]
INSTRUCTION = "Extract the contact record from this note."


def example(rng: random.Random, first: list[str], last: list[str], city: list[str]) -> dict[str, str]:
    name = f"{rng.choice(first)} {rng.choice(last)}"
    where = rng.choice(city)
    ext = f"{rng.randint(1000, 9999)}"
    sentence = rng.choice(TEMPLATES).format(name=name, city=where, ext=ext)
    return {"instruction": INSTRUCTION, "input": sentence, "output": f"name={name}; city={where}; ext={ext}"}


def main() -> None:
    out = Path(__file__).resolve().parent.parent / "src" / "shardfit" / "demo"
    rng = random.Random(1234)
    train = [example(rng, FIRST, LAST, CITY) for _ in range(480)]
    held = [example(rng, HELD_FIRST, HELD_LAST, HELD_CITY) for _ in range(48)]
    for name, rows in (("train.jsonl", train), ("heldout.jsonl", held)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(rows)} rows to {out / name}")


if __name__ == "__main__":
    main()
