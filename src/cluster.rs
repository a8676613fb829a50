//! `palisade serve` with a lease authority outside the store (etcd), and
//! cluster mode (docs/decisions/0011-etcd-lease-authority.md,
//! docs/decisions/0012-cluster-mode.md).

use std::sync::Arc;

use anyhow::Context;
use palisade_etcd::{EtcdAuthority, EtcdConfig};
use palisade_log::Store;
use tracing::info;

use crate::config::{LeaseBackend, ServeConfig};

/// Bind the configured lease authority to the store before it serves:
/// nothing for the embedded one (after checking the store's tokens came
/// from it), a connected etcd authority otherwise.
pub async fn bind_lease_backend(
    store: &Store,
    config: &ServeConfig,
) -> anyhow::Result<Option<Arc<EtcdAuthority>>> {
    match config.lease_backend {
        LeaseBackend::Embedded => {
            store.check_embedded_backend()?;
            Ok(None)
        }
        LeaseBackend::Etcd => {
            let mut cfg = EtcdConfig::new(config.etcd_endpoints.clone());
            cfg.prefix.clone_from(&config.etcd_prefix);
            let etcd = Arc::new(
                EtcdAuthority::connect(cfg)
                    .await
                    .context("lease backend etcd")?,
            );
            store.use_remote_authority(etcd.clone())?;
            info!(endpoints = ?config.etcd_endpoints, prefix = %config.etcd_prefix, "leases from etcd");
            Ok(Some(etcd))
        }
    }
}
