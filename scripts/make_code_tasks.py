"""Writes the bundled EASY Python coding set: data/code/easy_{train,heldout}.jsonl.

Each line is one problem in HumanEval's schema, plus a `family` field:

    task_id             "Easy/train/<i>" or "Easy/heldout/<i>"
    prompt              `def <entry_point>(<args>) -> <type>:` and a docstring (a sentence plus one `>>>` example),
                        ending with a newline; the model writes the body
    entry_point         the function's name
    canonical_solution  the indented body only: `prompt + canonical_solution` is a complete, correct function
    test                `def check(candidate):` with 5 top-level `assert candidate(<literals>) == <literal>` lines
    family              which of the 16 problem families it comes from

Every family has four variants (different constants, characters, wording and function names); three go to train
(48 rows) and one to held-out (16 rows), so held-out names and parameters never occur in training. Expected values
are computed by the canonical solution here; before writing, the script checks that every canonical solution passes
its test and that each assert fails on its own when the body is `return None` or `pass`. Stdlib only, fixed seed:

    python scripts/make_code_tasks.py
"""

import copy
import json
import random
import textwrap
from collections import Counter
from pathlib import Path

SENTENCES = [
    "Hello World",
    "Python 3 is fun",
    "I ate 2 apples and 3 pears",
    "Queen Bee buzzes",
    "the quick brown fox",
    "Sassy seas at 5 AM",
    "Open the door, Rose!",
    "NASA sent 12 probes",
    "a cat sat on a mat",
    "Eerie oboe solo",
    "Zebra ZONE 99",
    "Mississippi",
    "rhythm",
    "Office hours: 9 to 5",
    "Good Morning USA",
    "sweet peas",
]
PHRASES = [
    "the quick brown fox",
    "hello world",
    "make it work first",
    "i like green tea",
    "python is fun",
    "keep calm and code on",
    "small steps every day",
    "read the docs",
    "sun moon and stars",
    "hELLO wORLD",
    "a big red balloon",
    "never stop learning",
    "open the window please",
    "PYTHON rocks",
    "go",
]
PALINDROMES = [
    "Racecar",
    "Level",
    "hello",
    "Noon",
    "python",
    "Madam",
    "abcba",
    "abca",
    "Step on no pets",
    "Never odd or even",
    "Was it a car, or a cat I saw?",
    "no-on",
    "top-spot",
    "race-car",
    "Refer",
    "Kayak",
    "banana",
    "Taco cat",
    "ab",
    "Red rum, sir, is murder",
    "x-y-x",
    "Dad",
]
WORDS = ["apple", "Apple", "pear", "PEAR", "fig", "Fig", "kiwi", "plum", "Plum"]


def ints(rng, lo=-9, hi=20, n=(3, 7)):
    return [rng.randint(lo, hi) for _ in range(rng.randint(*n))]


def distinct3(rng):
    while len(set(nums := ints(rng, 0, 15, (4, 7)))) < 3:
        pass
    return nums


def fizz_n(rng, v):
    return (rng.choice([v["a"] * rng.randint(1, 4), v["b"] * rng.randint(1, 4), v["a"] * v["b"], rng.randint(1, 50)]),)


def merge_args(rng, v):
    a, b = sorted(ints(rng, 0, 12, (1, 5))), sorted(ints(rng, 0, 12, (1, 5)))
    return (a[::-1], b[::-1]) if v.get("desc") else (a, b)


def runs(rng):
    out = ""
    for _ in range(rng.randint(2, 5)):
        ch = rng.choice([c for c in "abcxyz" if not out.endswith(c)])
        out += ch * rng.randint(1, 4)
    return out


# Each family: defaults (sig, ret, doc, body, gen) overridden per variant; body and doc are str.format'ed with the
# variant. gen(rng, variant) returns one argument tuple. The LAST variant of each family is the held-out one.
FAMILIES = {
    "scale_sum": dict(
        sig="a: int, b: int",
        ret="int",
        doc="Return the sum of a and b multiplied by {k}.",
        body="return (a + b) * {k}",
        gen=lambda rng, v: (rng.randint(-20, 20), rng.randint(-20, 20)),
        variants=[
            dict(name="add_times_two", k=2),
            dict(name="add_then_triple", k=3),
            dict(name="sum_times_five", k=5),
            dict(name="add_times_seven", k=7),
        ],
    ),
    "list_extreme": dict(
        sig="nums: list[int]",
        ret="int",
        doc="Return the {what} in the non-empty list nums.",
        body="return {expr}",
        gen=lambda rng, v: (ints(rng),),
        variants=[
            dict(name="largest", what="largest number", expr="max(nums)"),
            dict(name="smallest", what="smallest number", expr="min(nums)"),
            dict(name="max_magnitude", what="largest absolute value of the numbers", expr="max(abs(x) for x in nums)"),
            dict(name="min_magnitude", what="smallest absolute value of the numbers", expr="min(abs(x) for x in nums)"),
        ],
    ),
    "count_class": dict(
        sig="s: str",
        ret="int",
        doc="Return how many {what} the string s contains.",
        body="return sum(1 for ch in s{cond})",
        gen=lambda rng, v: (rng.choice(SENTENCES),),
        variants=[
            dict(name="count_vowels", what="vowels (a, e, i, o, u, in either case)", cond=".lower() if ch in 'aeiou'"),
            dict(name="count_uppercase", what="uppercase letters", cond=" if ch.isupper()"),
            dict(name="count_digits", what="digit characters (0-9)", cond=" if ch.isdigit()"),
            dict(
                name="count_consonants",
                what="consonants (letters other than a, e, i, o, u, in either case)",
                cond=".lower() if ch.isalpha() and ch not in 'aeiou'",
            ),
        ],
    ),
    "count_char": dict(
        sig="s: str",
        ret="int",
        doc="Return how many times the character {ch!r} occurs in the string s (case-sensitive).",
        body="return s.count({ch!r})",
        gen=lambda rng, v: (rng.choice(SENTENCES),),
        variants=[
            dict(name="count_a", ch="a"),
            dict(name="count_e_chars", ch="e"),
            dict(name="occurrences_of_s", ch="s"),
            dict(name="count_letter_o", ch="o"),
        ],
    ),
    "reverse_words": dict(
        sig="sentence: str",
        ret="str",
        doc="Return the words of sentence in reverse order, joined by {sep!r}.",
        body="return {sep!r}.join(reversed(sentence.split()))",
        gen=lambda rng, v: (rng.choice(PHRASES),),
        variants=[
            dict(name="reverse_words", sep=" "),
            dict(name="reverse_words_csv", sep=", "),
            dict(name="reverse_words_dashed", sep="-"),
            dict(name="reverse_words_piped", sep=" | "),
        ],
    ),
    "sum_multiples": dict(
        sig="nums: list[int]",
        ret="int",
        doc="Return the sum of the numbers in nums that are divisible by {d}.",
        body="return sum(x for x in nums if x % {d} == 0)",
        gen=lambda rng, v: (ints(rng),),
        variants=[
            dict(name="sum_of_evens", d=2, doc="Return the sum of the even numbers in nums."),
            dict(name="sum_multiples_of_three", d=3),
            dict(name="sum_multiples_of_five", d=5),
            dict(name="sum_multiples_of_four", d=4),
        ],
    ),
    "palindrome": dict(
        sig="s: str",
        ret="bool",
        doc="Return True if s reads the same forwards and backwards, ignoring {what}.",
        body="t = {clean}\nreturn t == t[::-1]",
        gen=lambda rng, v: (rng.choice(PALINDROMES),),
        variants=[
            dict(name="is_palindrome", what="case", clean="s.lower()"),
            dict(name="is_palindrome_no_spaces", what="case and spaces", clean="s.lower().replace(' ', '')"),
            dict(
                name="is_palindrome_alnum",
                what="case and every character that is not a letter or digit",
                clean="[ch.lower() for ch in s if ch.isalnum()]",
            ),
            dict(name="is_palindrome_no_dashes", what="case and '-' characters", clean="s.lower().replace('-', '')"),
        ],
    ),
    "fizzbuzz": dict(
        sig="n: int",
        ret="str",
        gen=fizz_n,
        doc="Return '{wa}{wb}' if n is divisible by both {a} and {b}, '{wa}' if only by {a}, '{wb}' if only by {b}, "
        "and otherwise n as a string.",
        body="if n % {a} == 0 and n % {b} == 0:\n    return {wa!r} + {wb!r}\nif n % {a} == 0:\n    return {wa!r}\n"
        "if n % {b} == 0:\n    return {wb!r}\nreturn str(n)",
        variants=[
            dict(name="fizzbuzz", a=3, b=5, wa="Fizz", wb="Buzz"),
            dict(name="foo_bar", a=2, b=7, wa="Foo", wb="Bar"),
            dict(name="ping_pong", a=3, b=4, wa="Ping", wb="Pong"),
            dict(name="zip_zap", a=5, b=6, wa="Zip", wb="Zap"),
        ],
    ),
    "running": dict(
        sig="nums: list[int]",
        ret="list[int]",
        gen=lambda rng, v: (ints(rng),),
        doc="Return a list whose i-th element is the {what} of nums[0] through nums[i].",
        body="out = []\nfor x in nums:\n    out.append(x if not out else {step})\nreturn out",
        variants=[
            dict(name="running_sum", what="sum", step="out[-1] + x"),
            dict(
                name="running_product",
                what="product",
                step="out[-1] * x",
                gen=lambda rng, v: ([rng.choice([-3, -2, -1, 1, 2, 3, 4]) for _ in range(rng.randint(3, 5))],),
            ),
            dict(name="running_max", what="largest", step="max(out[-1], x)"),
            dict(name="running_min", what="smallest", step="min(out[-1], x)"),
        ],
    ),
    "kth_distinct": dict(
        sig="nums: list[int]",
        ret="int",
        doc="Return the {rank} distinct value in nums (it has at least three).",
        body="return sorted(set(nums))[{idx}]",
        gen=lambda rng, v: (distinct3(rng),),
        variants=[
            dict(name="second_largest", rank="second largest", idx=-2),
            dict(name="second_smallest", rank="second smallest", idx=1),
            dict(name="third_largest", rank="third largest", idx=-3),
            dict(name="third_smallest", rank="third smallest", idx=2),
        ],
    ),
    "dedupe": dict(
        sig="nums: list[int]",
        ret="list[int]",
        gen=lambda rng, v: (ints(rng, 0, 5, (4, 8)),),
        doc="Return nums with duplicate values removed, keeping the first occurrence of each in the original order.",
        body="seen = set()\nout = []\nfor x in nums:\n    if x not in seen:\n        seen.add(x)\n"
        "        out.append(x)\nreturn out",
        variants=[
            dict(name="remove_duplicates"),
            dict(
                name="unique_words_ignore_case",
                sig="words: list[str]",
                ret="list[str]",
                gen=lambda rng, v: ([rng.choice(WORDS) for _ in range(rng.randint(3, 6))],),
                doc="Return words without case-insensitive duplicates, keeping the first occurrence of each "
                "in the original order.",
                body="seen = set()\nout = []\nfor w in words:\n    if w.lower() not in seen:\n"
                "        seen.add(w.lower())\n        out.append(w)\nreturn out",
            ),
            dict(
                name="values_seen_once",
                doc="Return the values that occur exactly once in nums, in their original order.",
                body="return [x for x in nums if nums.count(x) == 1]",
            ),
            dict(
                name="unique_chars",
                sig="s: str",
                ret="str",
                gen=lambda rng, v: (runs(rng) + runs(rng),),
                doc="Return s with repeated characters removed, keeping the first occurrence of each in order.",
                body="out = ''\nfor ch in s:\n    if ch not in out:\n        out += ch\nreturn out",
            ),
        ],
    ),
    "capitalize": dict(
        sig="sentence: str",
        ret="str",
        gen=lambda rng, v: (rng.choice(PHRASES),),
        doc="Return sentence with every word longer than {n} letters in uppercase, words joined by single spaces.",
        body="return ' '.join(w.upper() if len(w) > {n} else w for w in sentence.split())",
        variants=[
            dict(
                name="capitalize_words",
                body="return ' '.join(w.capitalize() for w in sentence.split())",
                doc="Return sentence with each word's first letter in uppercase and the rest in lowercase, "
                "words joined by single spaces.",
            ),
            dict(name="shout_words_over_three", n=3),
            dict(name="shout_words_over_five", n=5),
            dict(name="shout_words_over_four", n=4),
        ],
    ),
    "digits": dict(
        sig="n: int",
        ret="int",
        gen=lambda rng, v: (rng.randint(0, 10 ** rng.randint(1, 5)),),
        doc="Return the {what} of the decimal digits of the non-negative integer n.",
        body="return sum(int(d) for d in str(n){cond})",
        variants=[
            dict(name="digit_sum", what="sum", cond=""),
            dict(name="digit_product", what="product", body="out = 1\nfor d in str(n):\n    out *= int(d)\nreturn out"),
            dict(
                name="even_digit_sum",
                what="sum of the even digits",
                cond=" if int(d) % 2 == 0",
                doc="Return the sum of the even decimal digits of the non-negative integer n.",
            ),
            dict(
                name="odd_digit_sum",
                what="sum of the odd digits",
                cond=" if int(d) % 2 == 1",
                doc="Return the sum of the odd decimal digits of the non-negative integer n.",
            ),
        ],
    ),
    "powers": dict(
        sig="nums: list[int]",
        ret="list[int]",
        gen=lambda rng, v: (ints(rng, -6, 9, (3, 7)),),
        doc="Return the {word}s of the {par} numbers in nums, in their original order.",
        body="return [x ** {p} for x in nums if x % 2 == {r}]",
        variants=[
            dict(name="odd_squares", word="square", par="odd", p=2, r=1),
            dict(name="even_cubes", word="cube", par="even", p=3, r=0),
            dict(name="even_squares", word="square", par="even", p=2, r=0),
            dict(name="odd_cubes", word="cube", par="odd", p=3, r=1),
        ],
    ),
    "merge_sorted": dict(
        sig="a: list[int], b: list[int]",
        ret="list[int]",
        gen=merge_args,
        doc="Merge the {src} lists a and b into one {dst} list{dup}.",
        body="return sorted({expr})",
        variants=[
            dict(name="merge_sorted", src="ascending", dst="ascending", dup=", keeping duplicates", expr="a + b"),
            dict(
                name="merge_sorted_unique",
                src="ascending",
                dst="ascending",
                dup=" without duplicate values",
                expr="set(a + b)",
            ),
            dict(
                name="merge_descending",
                src="descending",
                dst="descending",
                dup=", keeping duplicates",
                expr="a + b, reverse=True",
                desc=True,
            ),
            dict(
                name="merge_unique_descending",
                src="ascending",
                dst="descending",
                dup=" without duplicate values",
                expr="set(a + b), reverse=True",
            ),
        ],
    ),
    "run_length": dict(
        sig="s: str",
        ret="str",
        gen=lambda rng, v: (runs(rng),),
        doc="Run-length encode s: each run of a repeated character becomes {what}.",
        body="out = []\ni = 0\nwhile i < len(s):\n    j = i\n    while j < len(s) and s[j] == s[i]:\n        j += 1\n"
        "    out.append({piece})\n    i = j\nreturn {result}",
        variants=[
            dict(
                name="run_length_encode",
                what="the character followed by the run length",
                piece="s[i] + str(j - i)",
                result="''.join(out)",
            ),
            dict(
                name="rle_count_first",
                what="the run length followed by the character",
                piece="str(j - i) + s[i]",
                result="''.join(out)",
            ),
            dict(
                name="char_runs",
                ret="list[tuple[str, int]]",
                piece="(s[i], j - i)",
                result="out",
                doc="Return a list of (character, run length) pairs for the runs of repeated characters in s.",
            ),
            dict(
                name="compress_runs",
                what="the character followed by the run length, omitting a length of 1",
                piece="s[i] + (str(j - i) if j - i > 1 else '')",
                result="''.join(out)",
            ),
        ],
    ),
}


def plain(value) -> bool:
    """Whether value is plain literal data (no None, no objects) that repr round-trips."""
    if isinstance(value, (list, tuple)):
        return all(plain(x) for x in value)
    if isinstance(value, dict):
        return all(plain(k) and plain(x) for k, x in value.items())
    return isinstance(value, (bool, int, float, str))


def make_problem(rng: random.Random, family: str, spec: dict, variant: dict) -> dict:
    v = {**{k: x for k, x in spec.items() if k != "variants"}, **variant}
    name, head = v["name"], f"def {v['name']}({v['sig']}) -> {v['ret']}:\n"
    body = textwrap.indent(v["body"].format(**v), "    ") + "\n"
    ns: dict = {}
    exec(head + body, ns)
    for _ in range(1000):  # 1 example + 5 distinct tests; a constant or identity function passes at most 3 tests
        cases: dict = {}  # "arg literals" -> (first argument, expected value)
        for args in (v["gen"](rng, v) for _ in range(100)):
            cases[", ".join(repr(a) for a in args)] = args[0], ns[name](*copy.deepcopy(args))
            if len(cases) == 6:
                break
        outs = [out for _, out in cases.values()]
        if (
            len(outs) == 6
            and all(x is not None and plain(x) for x in outs)
            and max(Counter(repr(x) for x in outs[1:]).values()) <= 3
            and sum(repr(a) == repr(x) for a, x in list(cases.values())[1:]) <= 3
        ):
            break
    else:
        raise RuntimeError(f"{name}: could not draw varied test cases")
    (ex_args, (_, ex_out)), *tests = cases.items()
    doc = textwrap.fill(v["doc"].format(**v), 100, subsequent_indent="    ")
    prompt = f'{head}    """{doc}\n    >>> {name}({ex_args})\n    {ex_out!r}\n    """\n'
    test = "def check(candidate):\n" + "".join(f"    assert candidate({a}) == {e!r}\n" for a, (_, e) in tests)
    return dict(prompt=prompt, entry_point=name, canonical_solution=body, test=test, family=family)


def verify(row: dict) -> None:
    """Fails loudly unless the canonical solution passes and every assert fails alone on a `None`/`pass` body."""
    ep = row["entry_point"]
    exec(row["prompt"] + row["canonical_solution"] + "\n" + row["test"] + f"\ncheck({ep})", {})
    asserts = row["test"].splitlines()[1:]
    assert 4 <= len(asserts) <= 6 and all(a.startswith("    assert candidate(") for a in asserts), row["task_id"]
    for stub in ("    return None\n", "    pass\n"):
        ns: dict = {}
        exec(row["prompt"] + stub, ns)
        for line in asserts:
            try:
                exec(line.strip(), {"candidate": ns[ep]})
            except Exception:
                continue
            raise AssertionError(f"{row['task_id']}: {line.strip()!r} passes with body {stub.strip()!r}")


def main(out_dir: str = "data/code", seed: int = 0) -> None:
    rng = random.Random(seed)
    splits: dict[str, list[dict]] = {"train": [], "heldout": []}
    for family, spec in FAMILIES.items():
        assert len(spec["variants"]) == 4, family
        for i, variant in enumerate(spec["variants"]):
            split = "heldout" if i == 3 else "train"
            row = make_problem(rng, family, spec, variant)
            splits[split].append({"task_id": f"Easy/{split}/{len(splits[split])}", **row})
    names = [r["entry_point"] for rows in splits.values() for r in rows]
    assert len(names) == len(set(names)), "entry points must be unique (held-out names disjoint from train)"
    bodies = [(r["family"], r["canonical_solution"]) for rows in splits.values() for r in rows]
    assert len(bodies) == len(set(bodies)), "every variant must differ in its parameters"
    for rows in splits.values():
        for row in rows:
            verify(row)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        with open(Path(out_dir) / f"easy_{split}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    counts = {split: Counter(r["family"] for r in rows) for split, rows in splits.items()}
    for family in FAMILIES:
        print(f"{family:16s} train={counts['train'][family]} heldout={counts['heldout'][family]}")
    print(f"{'total':16s} train={len(splits['train'])} heldout={len(splits['heldout'])} -> {out_dir}")


if __name__ == "__main__":
    main()
