"""Live pages: background code publishes rendered HTML fragments to a group (live.publish); browsers
on a page join that group over a websocket (live.consumers.LiveConsumer), and the htmx ws extension
swaps the fragments in by element id. Every app imports this package; it imports none of them."""
