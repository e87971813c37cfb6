"""Install the notifications of deployments/automations.yaml on the server of PREFECT_API_URL.

    python deployments/automations.py --webhook-url https://hooks.example.com/T000/B000/XXXX
    python deployments/automations.py --webhook-url http://10.0.0.5:9000/hook --allow-private-urls

Saves (or updates) the webhook block ``drafter-alerts`` — each notification is POSTed as JSON
``{"subject": …, "body": …}`` — then creates the automations of the YAML file with the block's id,
replacing automations of the same names. Prints the automations it created.
"""
from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent


async def install(webhook_url: str, block_name: str, allow_private_urls: bool, path: Path) -> list[str]:
    from prefect import get_client
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.events.schemas.automations import AutomationCore

    block = CustomWebhookNotificationBlock(name=block_name, url=webhook_url, method="POST",
                                           json_data={"subject": "{{subject}}", "body": "{{body}}"},
                                           allow_private_urls=allow_private_urls)
    block_id = await block.save(block_name, overwrite=True)
    data = yaml.safe_load(path.read_text())["automations"]
    names = []
    async with get_client() as client:
        for a in data:
            for action in a.get("actions", []):
                if action.get("block_document_id") == "WEBHOOK_BLOCK_ID":
                    action["block_document_id"] = str(block_id)
            for old in await client.read_automations_by_name(a["name"]):
                await client.delete_automation(old.id)
            await client.create_automation(AutomationCore.model_validate(a))
            names.append(a["name"])
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--webhook-url", required=True, help="Where notifications are POSTed.")
    ap.add_argument("--block-name", default="drafter-alerts", help="Name of the webhook block (default: drafter-alerts).")
    ap.add_argument("--allow-private-urls", action="store_true", help="Allow a webhook on a private or loopback address.")
    ap.add_argument("--file", type=Path, default=HERE / "automations.yaml", help="The automations (default: next to this script).")
    args = ap.parse_args()
    names = asyncio.run(install(args.webhook_url, args.block_name, args.allow_private_urls, args.file))
    print("automations: " + ", ".join(names))


if __name__ == "__main__":
    main()
