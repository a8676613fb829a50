//! `palisade config check`: the settings `palisade serve --config FILE`
//! would run with, resolved and validated by `palisade-server` exactly as
//! `serve` does, and printed with where each comes from.

use std::ffi::OsString;

use clap::{Args, FromArgMatches};
use palisade_server::config::file::{resolve, settings, unset_note, Source};
use palisade_server::ServeArgs;

use crate::{out, CheckArgs, Failure};

/// `palisade config check [--config FILE]`: the settings `palisade serve
/// --config FILE` would run with (this environment, no flags), validated.
pub(crate) fn check(a: &CheckArgs) -> Result<(), Failure> {
    let mut argv: Vec<OsString> = vec!["serve".into()];
    if let Some(p) = &a.config {
        argv.extend(["--config".into(), p.clone().into_os_string()]);
    }
    let cmd = ServeArgs::augment_args(clap::Command::new("serve"));
    let m = cmd
        .try_get_matches_from(argv)
        .map_err(|e| Failure::Invalid(e.to_string().trim_end().to_owned()))?;
    let args = ServeArgs::from_arg_matches(&m)
        .map_err(|e| Failure::Invalid(e.to_string().trim_end().to_owned()))?;
    let r = resolve(args, &m).map_err(|e| Failure::Invalid(e.to_string()))?;
    r.config
        .validate()
        .map_err(|e| Failure::Invalid(e.to_string()))?;
    // The security file, TLS files and bind policy, as `serve` checks them.
    palisade_server::security::prepare(&r.config)
        .map_err(|e| Failure::Invalid(format!("{e:#}")))?;
    let file = r.file.as_ref().map(|p| p.display().to_string());
    if a.json {
        let settings: serde_json::Map<String, serde_json::Value> = settings(&r)
            .into_iter()
            .map(|s| {
                let value = s.value.map_or(serde_json::Value::Null, |v| {
                    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
                });
                (
                    s.key,
                    serde_json::json!({ "value": value, "source": s.source.name() }),
                )
            })
            .collect();
        let doc = serde_json::json!({ "ok": true, "config_file": file, "settings": settings });
        return out(doc);
    }
    match &file {
        Some(f) => out(format!("{f}: OK")),
        None => out("no config file (--config or PALISADE_CONFIG): checked the environment and the defaults"),
    }?;
    out("# effective settings for `palisade serve` (flag > environment > file > default)")?;
    for s in settings(&r) {
        let k = &s.key;
        let line = match s.value {
            Some(v) => {
                let from = match (s.source, &s.env) {
                    (Source::Env, Some(var)) => format!("env {var}"),
                    (other, _) => other.name().to_owned(),
                };
                format!("{:<40} # {from}", format!("{k} = {v}"))
            }
            None => format!("# {k}: unset ({})", unset_note(k)),
        };
        out(line)?;
    }
    Ok(())
}
