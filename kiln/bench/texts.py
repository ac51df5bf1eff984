"""The long inputs of the prompt set (``kiln/bench/prompts.py``), written for kiln.

They are part of the versioned prompt set: editing one changes the set's hash, which the
tests hold to the version number (bump ``PROMPT_SET_VERSION`` with any change here).
"""

DESIGN_NOTE = """\
Design note: moving the nightly report pipeline from cron to a queue

Status: proposed. Authors: the data platform team. Reviewers: storage, on-call, finance.

1. Where we are

Every night at 01:00 a cron job on a single virtual machine starts the report pipeline. It
reads the previous day's order events from the warehouse, joins them with the customer and
product tables, computes about forty aggregate tables, renders two hundred and twelve PDF
reports and mails them to their owners. The whole run takes between two and five hours,
depending on the volume of the day and on how busy the warehouse is. When it fails, it fails
as a whole: the on-call engineer restarts it from the beginning, and the reports arrive late,
sometimes after the business day has started in the eastern offices.

Over the last quarter the pipeline failed on eleven nights. Seven failures were timeouts of
the warehouse connection during the join, two were a full disk on the virtual machine (the
rendering step writes temporary files and never cleans them up when it crashes), one was an
expired mail relay certificate and one was a schema change in the product table that nobody
announced. The median time to recovery was two hours and forty minutes, most of it spent
waiting for the restarted run to get back to where the failed one stopped.

2. What we propose

We split the pipeline into three kinds of task: extract (one per source table and day),
aggregate (one per aggregate table) and render (one per report). Each task is a message on a
durable queue, carries the identifiers of the inputs it needs, and writes its output to object
storage under a key derived from those inputs. A task whose output key already exists is
skipped, so a task can be retried any number of times and a restarted pipeline resumes where
it stopped instead of starting again. Workers are stateless containers; we start with four and
let the queue depth decide how many run, up to twelve.

The scheduler that fills the queue stays a cron entry, but it only enqueues the extract tasks.
Each finished task enqueues the tasks that depend on it once all their inputs exist. We
considered a workflow engine for this and decided against it for now: the dependency graph is
small and static, and the team would have to operate one more service. The decision should be
revisited if the graph grows past a few hundred nodes or starts changing every week.

3. Failure handling

A task that fails is retried three times with exponential back-off starting at one minute. After
the third failure it goes to a dead-letter queue and pages the on-call engineer, who can fix the
cause and move the message back. Warehouse timeouts, the most common failure today, become
retries of a single extract task instead of a restart of the whole night. Temporary files move
to the worker's scratch volume, which is discarded with the container, so a crash can no longer
fill a disk. Schema changes are caught by a contract check in the extract task: the columns it
reads are declared, and a missing or retyped column fails the task with a message naming it.

4. Costs

The queue and object storage cost about one hundred and forty dollars a month at our volume.
Workers run only while there is work; at four to twelve small containers for roughly two hours,
the compute cost is slightly lower than the virtual machine we run all day today, which can be
switched off. The main cost is engineering time: we estimate five weeks for two engineers,
including a month of running both pipelines side by side and comparing their outputs byte for
byte before the old one is retired.

5. Risks

The outputs of the new pipeline may differ from the old one in ways that are hard to see, for
example in the rounding of currency amounts, because the aggregations move from one large SQL
script to many smaller queries. The side-by-side month is meant to catch this, but only for the
reports that are produced during that month; quarterly reports will not be compared. Finance
asked for a manual check of the first quarterly run.

Idempotent tasks depend on output keys being derived from everything that influences the
output. If a task reads an input that is not part of its key, such as a currency rate table that
is updated in place, a retried task may skip work it should redo. We will list every input of
every task during the design review and reject tasks whose inputs cannot be named.

The dead-letter queue moves the decision to the on-call engineer, who may not know the business
meaning of a failed report. We will write a runbook entry for each task kind and link it from
the page.

6. Open questions

Should reports be mailed as soon as they are ready, or all together at a fixed time, as today?
Owners of the eastern reports want them early; finance wants all reports to reflect the same
data. Should the workers run in the same region as the warehouse, which is cheaper and faster,
or in the region of the object storage, which the security team prefers? Who owns the contract
checks when a source team changes its schema: the source team or us?

7. Plan

Week one: the queue, object storage layout and the worker skeleton. Weeks two and three: extract
and aggregate tasks with their contract checks. Week four: rendering and mail. Then four weeks
of side-by-side runs, after which the cron job is removed and the virtual machine switched off.
"""

INVENTORY_MODULE = '''\
"""A small inventory service: stock levels, reservations and reorder suggestions."""

import datetime
import json
import threading


class Inventory:
    def __init__(self, path):
        self.path = path
        self.lock = threading.Lock()
        self.items = {}
        self.reservations = []

    def load(self):
        with open(self.path) as handle:
            data = json.load(handle)
        for sku, entry in data["items"].items():
            self.items[sku] = {"stock": entry["stock"], "minimum": entry.get("minimum", 0)}
        self.reservations = data.get("reservations", [])

    def save(self):
        data = {"items": self.items, "reservations": self.reservations}
        with open(self.path, "w") as handle:
            json.dump(data, handle)

    def available(self, sku):
        reserved = sum(r["quantity"] for r in self.reservations if r["sku"] == sku)
        return self.items[sku]["stock"] - reserved

    def reserve(self, sku, quantity, order_id, days=2):
        if quantity <= 0:
            raise ValueError("quantity must be positive")
        if self.available(sku) > quantity:
            expires = datetime.datetime.now() + datetime.timedelta(days=days)
            with self.lock:
                self.reservations.append(
                    {"sku": sku, "quantity": quantity, "order": order_id, "expires": expires}
                )
            return True
        return False

    def release(self, order_id):
        for reservation in self.reservations:
            if reservation["order"] == order_id:
                self.reservations.remove(reservation)

    def ship(self, order_id):
        with self.lock:
            for reservation in self.reservations:
                if reservation["order"] == order_id:
                    self.items[reservation["sku"]]["stock"] -= reservation["quantity"]
            self.release(order_id)

    def expire(self, now=None):
        now = now or datetime.datetime.now()
        self.reservations = [r for r in self.reservations if r["expires"] < now]

    def receive(self, sku, quantity):
        if sku not in self.items:
            self.items[sku] = {"stock": 0, "minimum": 0}
        self.items[sku]["stock"] =+ quantity

    def reorder_suggestions(self, lead_days, daily_sales):
        suggestions = {}
        for sku, entry in self.items.items():
            expected = daily_sales.get(sku, 0) * lead_days
            if self.available(sku) - expected < entry["minimum"]:
                suggestions[sku] = entry["minimum"] + expected - self.available(sku)
        return suggestions

    def report(self):
        lines = []
        for sku in sorted(self.items):
            lines.append(f"{sku}: {self.items[sku]['stock']} in stock, {self.available(sku)} available")
        return "\\n".join(lines)


def average_daily_sales(orders, days):
    totals = {}
    for order in orders:
        for line in order["lines"]:
            totals[line["sku"]] = totals.get(line["sku"], 0) + line["quantity"]
    return {sku: total / days for sku, total in totals.items()}


def parse_orders(text):
    orders = []
    for raw in text.split("\\n"):
        if not raw:
            continue
        order_id, sku, quantity = raw.split(",")
        orders.append({"id": order_id, "lines": [{"sku": sku, "quantity": quantity}]})
    return orders


def main(path, orders_path, lead_days=7):
    inventory = Inventory(path)
    inventory.load()
    with open(orders_path) as handle:
        orders = parse_orders(handle.read())
    sales = average_daily_sales(orders, 30)
    for sku, amount in inventory.reorder_suggestions(lead_days, sales).items():
        print(f"reorder {sku}: {amount:.0f}")
    inventory.expire()
    inventory.save()
'''
