"""The prompts `metaloom bench speculative` decodes: ``grounded`` (two code edits and a summary,
where the output quotes the input, so prompt lookup and the other input-copying drafters have
something to find) and ``free`` (open-ended generation: the drafts come from the model's own
text)."""

from __future__ import annotations

CODE = '''import json
from dataclasses import dataclass


@dataclass
class Order:
    order_id: int
    customer: str
    items: list[str]
    total: float


def load_orders(path):
    """Read orders from a JSON file."""
    with open(path) as f:
        data = json.load(f)
    orders = []
    for record in data:
        orders.append(Order(record["order_id"], record["customer"], record["items"], record["total"]))
    return orders


def total_revenue(orders):
    """Sum the totals of all orders."""
    revenue = 0.0
    for order in orders:
        revenue += order.total
    return revenue
'''
TEXT = ("The city council met on Tuesday to discuss the new bicycle lanes on Main Street. Residents said the lanes "
        "made cycling safer, but several shop owners complained that the loss of parking hurt their business. "
        "The council agreed to count cyclists and parked cars for three months before deciding whether to keep "
        "the lanes, and asked the transport office to publish the counts every week.")
PROMPTS = (
    f"Rename the function `total_revenue` to `compute_revenue` in the following code. Output the complete "
    f"updated code and nothing else.\n\n```python\n{CODE}```",
    f"Add a docstring-preserving type hint `-> list[Order]` to `load_orders` in this code and output the whole "
    f"file.\n\n```python\n{CODE}```",
    f"Summarise this news text in two sentences, reusing its wording.\n\n{TEXT}",
)
# free generation: nothing in the prompt to copy, so the drafts come from the model's own text
FREE_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, step by step, for a curious ten-year-old.",
    "Write a Python function that checks whether a string is a palindrome, with a short explanation.",
)
PROMPT_SETS = {"grounded": PROMPTS, "free": FREE_PROMPTS}
