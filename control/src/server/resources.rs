//! The tenant resources' handlers: tenants, namespaces, streams and caches (CRUD and shard
//! listings), each a thin call into the store, with the bearer check done by the middleware
//! and, where the need depends on the body, by `permit`.

use super::*;

// ------------------------------------------------------------------ tenants

#[utoipa::path(get, path = "/v1/tenants", tag = "tenants",
    responses((status = 200, body = Vec<Tenant>)))]
pub(super) async fn list_tenants(State(st): State<Arc<AppState>>) -> Json<Vec<Tenant>> {
    Json(st.read(|c| c.tenants().cloned().collect()))
}

#[utoipa::path(post, path = "/v1/tenants", tag = "tenants", request_body = CreateTenant,
    responses((status = 201, body = Tenant), (status = 400, body = ErrorBody),
              (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(super) async fn create_tenant(
    State(st): State<Arc<AppState>>,
    Json(req): Json<CreateTenant>,
) -> Res<(StatusCode, Json<Tenant>)> {
    match st.write(Command::CreateTenant { req }).await? {
        Reply::Tenant(t) => Ok((StatusCode::CREATED, Json(t))),
        other => Err(unexpected(other)),
    }
}

#[utoipa::path(get, path = "/v1/tenants/{tenant}", tag = "tenants",
    params(("tenant" = String, Path)),
    responses((status = 200, body = Tenant), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn get_tenant(
    State(st): State<Arc<AppState>>,
    Path(tenant): Path<String>,
) -> Res<Json<Tenant>> {
    Ok(Json(st.read(|c| c.tenant(&tenant).cloned())?))
}

#[utoipa::path(patch, path = "/v1/tenants/{tenant}", tag = "tenants",
    params(("tenant" = String, Path)), request_body = UpdateTenant,
    responses((status = 200, body = Tenant), (status = 400, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(super) async fn update_tenant(
    State(st): State<Arc<AppState>>,
    Path(name): Path<String>,
    Json(req): Json<UpdateTenant>,
) -> Res<Json<Tenant>> {
    match st.write(Command::UpdateTenant { name, req }).await? {
        Reply::Tenant(t) => Ok(Json(t)),
        other => Err(unexpected(other)),
    }
}

#[utoipa::path(delete, path = "/v1/tenants/{tenant}", tag = "tenants",
    params(("tenant" = String, Path)),
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(super) async fn delete_tenant(
    State(st): State<Arc<AppState>>,
    Path(name): Path<String>,
) -> Res<StatusCode> {
    st.write(Command::DeleteTenant { name }).await?;
    Ok(StatusCode::NO_CONTENT)
}

// ------------------------------------------------------------------ namespaces

#[utoipa::path(get, path = "/v1/tenants/{tenant}/namespaces", tag = "namespaces",
    params(("tenant" = String, Path)),
    responses((status = 200, body = Vec<Namespace>), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn list_namespaces(
    State(st): State<Arc<AppState>>,
    Path(tenant): Path<String>,
) -> Res<Json<Vec<Namespace>>> {
    Ok(Json(st.read(|c| c.namespaces(&tenant))?))
}

#[utoipa::path(post, path = "/v1/tenants/{tenant}/namespaces", tag = "namespaces",
    params(("tenant" = String, Path)), request_body = CreateNamespace,
    responses((status = 201, body = Namespace), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(super) async fn create_namespace(
    State(st): State<Arc<AppState>>,
    Path(tenant): Path<String>,
    Json(req): Json<CreateNamespace>,
) -> Res<(StatusCode, Json<Namespace>)> {
    match st.write(Command::CreateNamespace { tenant, req }).await? {
        Reply::Namespace(n) => Ok((StatusCode::CREATED, Json(n))),
        other => Err(unexpected(other)),
    }
}

#[utoipa::path(get, path = "/v1/tenants/{tenant}/namespaces/{namespace}", tag = "namespaces",
    params(("tenant" = String, Path), ("namespace" = String, Path)),
    responses((status = 200, body = Namespace), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn get_namespace(
    State(st): State<Arc<AppState>>,
    Path((t, n)): Path<(String, String)>,
) -> Res<Json<Namespace>> {
    Ok(Json(st.read(|c| c.namespace(&t, &n).cloned())?))
}

#[utoipa::path(patch, path = "/v1/tenants/{tenant}/namespaces/{namespace}", tag = "namespaces",
    params(("tenant" = String, Path), ("namespace" = String, Path)), request_body = UpdateNamespace,
    responses((status = 200, body = Namespace), (status = 400, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(super) async fn update_namespace(
    State(st): State<Arc<AppState>>,
    Path((tenant, name)): Path<(String, String)>,
    Json(req): Json<UpdateNamespace>,
) -> Res<Json<Namespace>> {
    match st
        .write(Command::UpdateNamespace { tenant, name, req })
        .await?
    {
        Reply::Namespace(n) => Ok(Json(n)),
        other => Err(unexpected(other)),
    }
}

#[utoipa::path(delete, path = "/v1/tenants/{tenant}/namespaces/{namespace}", tag = "namespaces",
    params(("tenant" = String, Path), ("namespace" = String, Path)),
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(super) async fn delete_namespace(
    State(st): State<Arc<AppState>>,
    Path((tenant, name)): Path<(String, String)>,
) -> Res<StatusCode> {
    st.write(Command::DeleteNamespace { tenant, name }).await?;
    Ok(StatusCode::NO_CONTENT)
}

// ------------------------------------------------------------------ streams

#[utoipa::path(get, path = "/v1/tenants/{tenant}/namespaces/{namespace}/streams", tag = "streams",
    params(("tenant" = String, Path), ("namespace" = String, Path)),
    responses((status = 200, body = Vec<Stream>), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn list_streams(
    State(st): State<Arc<AppState>>,
    Path((t, n)): Path<(String, String)>,
) -> Res<Json<Vec<Stream>>> {
    Ok(Json(st.read(|c| c.streams(&t, &n))?))
}

/// `replication_factor > 1` and `consistency: quorum` answer 400 `unsupported` until
/// replication exists.
#[utoipa::path(post, path = "/v1/tenants/{tenant}/namespaces/{namespace}/streams", tag = "streams",
    params(("tenant" = String, Path), ("namespace" = String, Path)), request_body = CreateStream,
    responses((status = 201, body = Stream), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(super) async fn create_stream(
    State(st): State<Arc<AppState>>,
    Path((tenant, namespace)): Path<(String, String)>,
    Json(req): Json<CreateStream>,
) -> Res<(StatusCode, Json<Stream>)> {
    match st
        .write(Command::CreateStream {
            tenant,
            namespace,
            req,
        })
        .await?
    {
        Reply::Stream(s) => Ok((StatusCode::CREATED, Json(s))),
        other => Err(unexpected(other)),
    }
}

#[utoipa::path(get, path = "/v1/tenants/{tenant}/namespaces/{namespace}/streams/{stream}", tag = "streams",
    params(("tenant" = String, Path), ("namespace" = String, Path), ("stream" = String, Path)),
    responses((status = 200, body = Stream), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn get_stream(
    State(st): State<Arc<AppState>>,
    Path((t, n, s)): Path<(String, String, String)>,
) -> Res<Json<Stream>> {
    Ok(Json(st.read(|c| c.stream(&t, &n, &s).cloned())?))
}

#[utoipa::path(get, path = "/v1/tenants/{tenant}/namespaces/{namespace}/streams/{stream}/shards", tag = "streams",
    params(("tenant" = String, Path), ("namespace" = String, Path), ("stream" = String, Path)),
    responses((status = 200, body = Vec<ShardPlacement>), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn stream_shards(
    State(st): State<Arc<AppState>>,
    Path((t, n, s)): Path<(String, String, String)>,
) -> Res<Json<Vec<ShardPlacement>>> {
    Ok(Json(st.read(|c| {
        c.stream(&t, &n, &s).map(|s| s.placement.clone())
    })?))
}

#[utoipa::path(patch, path = "/v1/tenants/{tenant}/namespaces/{namespace}/streams/{stream}", tag = "streams",
    params(("tenant" = String, Path), ("namespace" = String, Path), ("stream" = String, Path)),
    request_body = UpdateStream,
    responses((status = 200, body = Stream), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(super) async fn update_stream(
    State(st): State<Arc<AppState>>,
    Path((tenant, namespace, name)): Path<(String, String, String)>,
    Json(req): Json<UpdateStream>,
) -> Res<Json<Stream>> {
    match st
        .write(Command::UpdateStream {
            tenant,
            namespace,
            name,
            req,
        })
        .await?
    {
        Reply::Stream(s) => Ok(Json(s)),
        other => Err(unexpected(other)),
    }
}

/// Marks the stream `deleting` (202). It disappears once every live broker has caught up with
/// the delete (or after the delete grace); until then its name answers 409 `conflict`.
#[utoipa::path(delete, path = "/v1/tenants/{tenant}/namespaces/{namespace}/streams/{stream}", tag = "streams",
    params(("tenant" = String, Path), ("namespace" = String, Path), ("stream" = String, Path)),
    responses((status = 202, body = Stream), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 503, body = ErrorBody)))]
pub(super) async fn delete_stream(
    State(st): State<Arc<AppState>>,
    Path((tenant, namespace, name)): Path<(String, String, String)>,
) -> Res<(StatusCode, Json<Stream>)> {
    match st
        .write(Command::DeleteStream {
            tenant,
            namespace,
            name,
        })
        .await?
    {
        Reply::Stream(s) => Ok((StatusCode::ACCEPTED, Json(s))),
        other => Err(unexpected(other)),
    }
}

// ------------------------------------------------------------------ caches

#[utoipa::path(get, path = "/v1/tenants/{tenant}/namespaces/{namespace}/caches", tag = "caches",
    params(("tenant" = String, Path), ("namespace" = String, Path)),
    responses((status = 200, body = Vec<Cache>), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn list_caches(
    State(st): State<Arc<AppState>>,
    Path((t, n)): Path<(String, String)>,
) -> Res<Json<Vec<Cache>>> {
    Ok(Json(st.read(|c| c.caches(&t, &n))?))
}

#[utoipa::path(post, path = "/v1/tenants/{tenant}/namespaces/{namespace}/caches", tag = "caches",
    params(("tenant" = String, Path), ("namespace" = String, Path)), request_body = CreateCache,
    responses((status = 201, body = Cache), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(super) async fn create_cache(
    State(st): State<Arc<AppState>>,
    Path((tenant, namespace)): Path<(String, String)>,
    Json(req): Json<CreateCache>,
) -> Res<(StatusCode, Json<Cache>)> {
    match st
        .write(Command::CreateCache {
            tenant,
            namespace,
            req,
        })
        .await?
    {
        Reply::Cache(c) => Ok((StatusCode::CREATED, Json(c))),
        other => Err(unexpected(other)),
    }
}

#[utoipa::path(get, path = "/v1/tenants/{tenant}/namespaces/{namespace}/caches/{cache}", tag = "caches",
    params(("tenant" = String, Path), ("namespace" = String, Path), ("cache" = String, Path)),
    responses((status = 200, body = Cache), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn get_cache(
    State(st): State<Arc<AppState>>,
    Path((t, n, s)): Path<(String, String, String)>,
) -> Res<Json<Cache>> {
    Ok(Json(st.read(|c| c.cache(&t, &n, &s).cloned())?))
}

#[utoipa::path(get, path = "/v1/tenants/{tenant}/namespaces/{namespace}/caches/{cache}/shards", tag = "caches",
    params(("tenant" = String, Path), ("namespace" = String, Path), ("cache" = String, Path)),
    responses((status = 200, body = Vec<ShardPlacement>), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn cache_shards(
    State(st): State<Arc<AppState>>,
    Path((t, n, s)): Path<(String, String, String)>,
) -> Res<Json<Vec<ShardPlacement>>> {
    Ok(Json(st.read(|c| {
        c.cache(&t, &n, &s).map(|s| s.placement.clone())
    })?))
}

#[utoipa::path(patch, path = "/v1/tenants/{tenant}/namespaces/{namespace}/caches/{cache}", tag = "caches",
    params(("tenant" = String, Path), ("namespace" = String, Path), ("cache" = String, Path)),
    request_body = UpdateCache,
    responses((status = 200, body = Cache), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(super) async fn update_cache(
    State(st): State<Arc<AppState>>,
    Path((tenant, namespace, name)): Path<(String, String, String)>,
    Json(req): Json<UpdateCache>,
) -> Res<Json<Cache>> {
    match st
        .write(Command::UpdateCache {
            tenant,
            namespace,
            name,
            req,
        })
        .await?
    {
        Reply::Cache(c) => Ok(Json(c)),
        other => Err(unexpected(other)),
    }
}

#[utoipa::path(delete, path = "/v1/tenants/{tenant}/namespaces/{namespace}/caches/{cache}", tag = "caches",
    params(("tenant" = String, Path), ("namespace" = String, Path), ("cache" = String, Path)),
    responses((status = 202, body = Cache), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 503, body = ErrorBody)))]
pub(super) async fn delete_cache(
    State(st): State<Arc<AppState>>,
    Path((tenant, namespace, name)): Path<(String, String, String)>,
) -> Res<(StatusCode, Json<Cache>)> {
    match st
        .write(Command::DeleteCache {
            tenant,
            namespace,
            name,
        })
        .await?
    {
        Reply::Cache(c) => Ok((StatusCode::ACCEPTED, Json(c))),
        other => Err(unexpected(other)),
    }
}
