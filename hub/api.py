from ninja import Router

storage_router = Router()
download_router = Router()
