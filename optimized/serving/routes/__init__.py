"""The HTTP routes, one module per family, each an `APIRouter` over the application state (`state.ServerState`)."""
