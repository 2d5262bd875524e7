"""The web side: pages, the Ninja API (management, usage, the inference mirror), the dashboard and
the websocket consumers. Nothing below it (control, proxy, node, adapters) imports it."""
