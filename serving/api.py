from ninja import Router

management_router = Router()
inference_router = Router()
