"""A small modern-English probe set, written for this project and kept out of every corpus.

The default corpora are old (scripture, 19th-century speeches) or narrow (a Wikipedia excerpt, 360 kB of news), so a
bank can look good on their held-out documents and still explain modern prompts with digit and comma prototypes.
prism.eval --probe scores the prototype path on these passages, each its own sequence after the end-of-text token
(how training documents begin). Four kinds: everyday writing, technical prose, news-style reports and source code.
The passages are original text made up for this purpose (no quotation of any source); names and events in the
news passages are invented. prism.eval reports how many of them occur in the corpus it evaluates on (0 expected).

    from prism.probe import PROBE        # [{"kind": "everyday", "text": "..."}, ...]
"""

from __future__ import annotations

_EVERYDAY = (
    "Hi Sam, thanks for dinner last night. I left my blue scarf on the chair by the door, so could you keep it "
    "until Saturday? I can pick it up on my way to the market.",
    "We're out of milk and eggs again. If you stop at the store after work, please grab a loaf of bread too, and "
    "maybe some apples for the kids' lunches.",
    "The train was twenty minutes late this morning, so I missed the start of the meeting. Next week I'm going to "
    "leave the house a little earlier and take the bus instead.",
    "My sister just adopted a puppy. He chews everything, sleeps all afternoon and then wants to play at three in "
    "the morning, but we already love him.",
    "Reminder: the dentist moved your appointment to Thursday at 4:30. Bring your insurance card and try not to "
    "eat anything sticky before you go.",
    "I tried the new coffee place on the corner today. The espresso was good, the music was too loud, and the "
    "chairs were so small that my knees hit the table.",
    "Can you water the plants while we're away? The big one in the kitchen needs a full glass every two days, and "
    "the small ones on the balcony only once a week.",
    "Happy birthday! I hope your day is full of cake, good friends and a long nap. Let's get lunch next week and "
    "celebrate properly.",
)

_TECHNICAL = (
    "To reset the router, hold the button on the back for ten seconds until the light turns orange. The device "
    "will restart and restore its factory settings, so write down your network password first.",
    "A hash table stores keys and values in an array of buckets. The hash function maps each key to a bucket, and "
    "collisions are handled by chaining entries in a list or by probing the next free slot.",
    "The battery lasts about eight hours under normal use. Lowering the screen brightness and turning off "
    "location services can extend it, while video calls drain it much faster.",
    "Before you install the update, back up your files to an external drive or a cloud account. The installer "
    "needs at least four gigabytes of free disk space and may restart the computer twice.",
    "In a relational database, an index speeds up queries that filter or sort on a column, but every insert and "
    "update must also change the index, so too many indexes slow down writes.",
    "The sensor reports temperature and humidity every five seconds over a serial connection. Each reading is a "
    "line of text with two numbers separated by a comma.",
    "Gradient descent updates the parameters of a model in the direction that lowers the loss. The learning rate "
    "controls the size of each step: too large and training diverges, too small and it barely moves.",
    "If the printer shows a paper jam, open the front cover, pull the sheet out slowly with both hands, and close "
    "the cover again. Do not touch the roller, which can be hot.",
)

_NEWS = (
    "The city council voted on Tuesday to extend the bike lane on Harbor Street by two miles. Supporters said it "
    "would make the commute safer, while some shop owners worried about losing parking spaces.",
    "Heavy rain flooded several roads in the northern suburbs overnight, and schools in the area will open two "
    "hours late on Wednesday. Officials asked drivers to avoid the river crossings.",
    "Shares of the regional airline rose eight percent after the company reported higher profits than expected "
    "and announced new routes to three coastal cities next spring.",
    "The national team won the final two to one after a late goal from their youngest player. Thousands of fans "
    "gathered in the main square to watch the match on a giant screen.",
    "Researchers at a university hospital said a new blood test can detect the disease months earlier than "
    "current methods. The results still need to be confirmed in a larger study.",
    "The museum will reopen next month after a two-year renovation that added a new wing for modern art, a rooftop "
    "cafe and free entry for visitors under eighteen.",
    "Energy prices fell for the third month in a row, according to figures released on Friday, easing pressure on "
    "households ahead of the winter heating season.",
    "Firefighters contained a brush fire near the highway on Sunday afternoon. No one was hurt, but smoke closed two "
    "lanes for several hours and delayed traffic into the city.",
)

_CODE = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "import json\n\nwith open(\"config.json\") as f:\n    config = json.load(f)\nprint(config[\"name\"])\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, \"is even\")\n    else:\n        print(i, \"is odd\")\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "function add(a, b) {\n  return a + b;\n}\n\nconsole.log(add(2, 3));\n",
    "SELECT name, COUNT(*) AS orders\nFROM customers\nJOIN orders ON orders.customer_id = customers.id\n"
    "GROUP BY name\nORDER BY orders DESC;\n",
    "def read_lines(path):\n    \"\"\"Return the lines of a text file without their line endings.\"\"\"\n"
    "    with open(path) as f:\n        return [line.rstrip(\"\\n\") for line in f]\n",
    "numbers = [3, 1, 4, 1, 5, 9, 2, 6]\nsorted_numbers = sorted(numbers)\nprint(sorted_numbers[0], "
    "sorted_numbers[-1])\n",
)

PROBE: tuple[dict[str, str], ...] = tuple(
    {"kind": kind, "text": text}
    for kind, texts in (("everyday", _EVERYDAY), ("technical", _TECHNICAL), ("news", _NEWS), ("code", _CODE))
    for text in texts
)
