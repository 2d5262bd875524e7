"""The control plane: the load plan (planning, placement, selection, capacity, allocation), the
commands the web side and the API issue (services), and the channel-layer groups and messages
(events). It imports neither the web side nor the data plane.

The instance model and its transition table are not here but in `serving.models`, below every
plane: Django's app models module, and the node's supervisor moves the states as control does."""
