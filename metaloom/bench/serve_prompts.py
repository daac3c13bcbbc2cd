"""The mixed chat prompts the serving benchmarks send (`metaloom bench serve`, `bench admit`), and
`tagged`, which makes each request's prompt its own so repeats do not measure a prefix cache.
"""

from __future__ import annotations

# Mixed chat prompts: short questions, medium instructions and long passages (a few tokens to
# ~400), so prefill and decode both count and a batching server sees uneven lengths. Each long
# prompt starts with its own instruction, so no two share more than the chat template's prefix.
_PRESS = (
    "Before the printing press, books in Europe were copied by hand, most often in monasteries, and a single "
    "Bible could take a scribe more than a year. Around 1440 Johannes Gutenberg, a goldsmith in Mainz, combined "
    "several existing ideas into a practical system: movable metal type cast from a hand mould, an oil-based ink "
    "that stuck to metal, and a screw press adapted from those used for wine and olive oil. His workshop printed "
    "about 180 copies of the Bible by 1455. Within fifty years presses were operating in more than two hundred "
    "European towns and had produced millions of volumes. Prices fell, literacy spread beyond the clergy and the "
    "nobility, and scholars could compare identical copies of a text for the first time, which helped standardise "
    "spelling and made errors easier to correct. The press also carried pamphlets, so new religious and political "
    "ideas travelled faster than authorities could suppress them.")
_LEAF = (
    "Photosynthesis takes place mainly in the chloroplasts of leaf cells. In the light-dependent reactions, "
    "chlorophyll absorbs light, water is split, oxygen is released, and the energy is stored in ATP and NADPH. "
    "In the Calvin cycle, which does not need light directly, the enzyme RuBisCO fixes carbon dioxide onto a "
    "five-carbon sugar, and ATP and NADPH from the first stage drive the reduction of the products into "
    "three-carbon sugars, some of which leave the cycle to build glucose, sucrose and starch. Because RuBisCO "
    "also reacts with oxygen, hot and dry conditions waste energy in photorespiration; C4 and CAM plants evolved "
    "ways to concentrate carbon dioxide around the enzyme to avoid this.")
_CODE = (
    "def merge(intervals):\n"
    "    intervals.sort(key=lambda x: x[0])\n"
    "    out = []\n"
    "    for start, end in intervals:\n"
    "        if out and start <= out[-1][1]:\n"
    "            out[-1][1] = max(out[-1][1], end)\n"
    "        else:\n"
    "            out.append([start, end])\n"
    "    return out\n")
_SALES = (
    "month,region,units,revenue\nJan,North,120,2400\nJan,South,95,1900\nFeb,North,130,2600\nFeb,South,80,1600\n"
    "Mar,North,150,3000\nMar,South,110,2200\nApr,North,90,1800\nApr,South,140,2800\n")

PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Say hello in three languages.",
    "What is 17 times 23?",
    "Name a primary colour.",
    "Write a haiku about autumn rain.",
    "Give me three tips for sleeping better.",
    "Explain what a hash table is in two sentences.",
    "What is the difference between weather and climate?",
    "Translate 'good morning, how are you?' into Spanish.",
    "List five animals that live in the ocean.",
    "Why is the sky blue? Answer briefly.",
    "Write a short, friendly email declining a meeting invitation for Thursday afternoon.",
    "Suggest a name for a small bakery that specialises in sourdough bread and explain the choice.",
    "Describe the water cycle to a ten-year-old, using simple words and one everyday example.",
    "What are the main advantages and disadvantages of working from home? Give two of each.",
    "I have eggs, spinach, cheese and bread. Suggest a quick breakfast and explain how to make it.",
    "Write a limerick about a cat who learns to program computers and becomes famous on the internet.",
    "Compare trains and planes for a 500 km trip in terms of time, cost, comfort and environmental impact.",
    "A farmer has 17 sheep; all but 9 run away. How many are left? Explain your reasoning step by step.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a short docstring.",
    "Explain recursion, then give a small example in Python and say what would happen without a base case.",
    "Plan a one-day itinerary for a first visit to Rome, with a morning, an afternoon and an evening activity.",
    f"Summarise the following passage in two sentences.\n\n{_PRESS}",
    f"List three consequences of the invention described below, one line each.\n\n{_PRESS}",
    f"Who is the person mentioned in this text and what did he build? Be brief.\n\n{_PRESS}",
    f"Explain the following text to a twelve-year-old.\n\n{_LEAF}",
    f"What problem do C4 plants solve, according to this passage?\n\n{_LEAF}",
    f"Explain what this Python function does and give its time complexity.\n\n{_CODE}",
    f"Find a bug or an edge case in this code, if there is one.\n\n{_CODE}",
    f"Which region sold more units in total? Show the sums.\n\n{_SALES}",
    f"Describe the trend in revenue per month for each region.\n\n{_SALES}",
    f"Write a title and a one-paragraph abstract for an essay based on these notes.\n\n{_PRESS}\n\n{_LEAF}",
)


def tagged(prompt: str, tag: str | None) -> str:
    """``prompt`` opened by a tag unique to its request, so that no two requests of one server
    run share more than the chat template's prefix: with the same 32 prompts sent again and
    again, a prefix cache would otherwise skip their whole prefill on every repeat, and a
    token-granular cache (metaloom's radix tree) would gain more from that than a block-granular
    one (vLLM's 128-token CPU blocks) -- a difference the repetition makes, not real traffic.
    A shared system prompt still hits both caches, as it would in real serving."""
    return prompt if tag is None else f"[{tag}] {prompt}"
