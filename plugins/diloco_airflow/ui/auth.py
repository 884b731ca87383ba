"""Airflow's authentication and authorization for the DiLoCo page's API.

A plugin's FastAPI app gets no Airflow auth by default (docs/AIRFLOW.md, PLATFORM.md), so every
API route depends on one of these:

- `reader`: a valid Airflow JWT (the `Authorization: Bearer` header, else the `_token` cookie the
  Airflow UI sets at login) of a user the auth manager lets read the `diloco_experiment` DAG.
- `editor`: the same, and the user may edit that DAG (what triggering and clearing need).

No token, or one the auth manager does not accept (bad signature, expired, revoked): 401.
A user without the permission: 403. The auth manager is Airflow's configured one
(`airflow.api_fastapi.app.get_auth_manager()`: SimpleAuthManager locally, FAB or Composer's in
production), so the page follows whatever roles the deployment has.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

DAG_ID = "diloco_experiment"
COOKIE = "_token"  # airflow.api_fastapi.auth.managers.base_auth_manager.COOKIE_NAME_JWT_TOKEN

_bearer = HTTPBearer(auto_error=False)


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(
        status.HTTP_401_UNAUTHORIZED, detail=detail, headers={"WWW-Authenticate": "Bearer"}
    )


async def current_user(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Any:
    """The Airflow user of this request (401 without a valid token)."""
    from airflow.api_fastapi.app import get_auth_manager

    if credentials is not None and credentials.scheme.lower() == "bearer":
        token = credentials.credentials
    else:
        # a user that Airflow's own JWTRefreshMiddleware validated and refreshed
        from airflow.api_fastapi.core_api.security import USER_INJECTED_BY_TRUSTED_MIDDLEWARE

        user = getattr(request.state, "user", None)
        if user and getattr(request.state, "user_authenticated_via", None) is (
            USER_INJECTED_BY_TRUSTED_MIDDLEWARE
        ):
            return user
        token = request.cookies.get(COOKIE)
    if not token:
        raise _unauthorized("not authenticated: log in to Airflow or send a Bearer token")
    try:
        return await get_auth_manager().get_user_from_token(token)
    except Exception:  # expired, bad signature, revoked, malformed: all the same to a client
        raise _unauthorized("invalid or expired token") from None


def can(user: Any, method: str, dag_id: str = DAG_ID) -> bool:
    """Whether Airflow's auth manager lets `user` do `method` ("GET": read, "PUT": edit) on
    `dag_id`."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails

    return bool(
        get_auth_manager().is_authorized_dag(
            method=method, details=DagDetails(id=dag_id), user=user
        )
    )


def reader(user: Annotated[Any, Depends(current_user)]) -> Any:
    if not can(user, "GET"):
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"you may not read the {DAG_ID} DAG")
    return user


def editor(user: Annotated[Any, Depends(current_user)]) -> Any:
    if not can(user, "PUT"):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, f"only users who may edit the {DAG_ID} DAG can do this"
        )
    return user


Reader = Annotated[Any, Depends(reader)]
Editor = Annotated[Any, Depends(editor)]
