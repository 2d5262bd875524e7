from ninja import Router

management_router = Router()
