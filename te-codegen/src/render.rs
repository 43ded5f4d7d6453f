//! Rendering specs to CUDA C++ with Tera.
//!
//! Templates are embedded in the binary (so a binary built here renders the same source on
//! the GPU machine), autoescape is off, and an undefined variable is an error.

use crate::spec::KernelSpec;
use crate::{Error, Result};
use std::sync::OnceLock;

/// The templates every family includes (`{% include %}`), by file name under
/// `te-codegen/templates/`.
pub const INCLUDES: &[(&str, &str)] = &[
    ("common.cuh.tera", include_str!("../templates/common.cuh.tera")),
    ("philox.cuh.tera", include_str!("../templates/philox.cuh.tera")),
    ("flash_attn_common.cuh.tera", include_str!("../templates/flash_attn_common.cuh.tera")),
    ("flash_attn_wgmma.cuh.tera", include_str!("../templates/flash_attn_wgmma.cuh.tera")),
    ("flash_attn_quantize.cuh.tera", include_str!("../templates/flash_attn_quantize.cuh.tera")),
    ("flash_attn_bwd_common.cuh.tera", include_str!("../templates/flash_attn_bwd_common.cuh.tera")),
];

/// Every template, by file name under `te-codegen/templates/`: [`INCLUDES`] and those of each
/// kernel family (the family list in `spec/mod.rs`).
pub fn templates() -> impl Iterator<Item = (&'static str, &'static str)> {
    INCLUDES.iter().chain(crate::spec::FAMILY_TEMPLATES).copied()
}

fn engine() -> &'static std::result::Result<tera::Tera, String> {
    static ENGINE: OnceLock<std::result::Result<tera::Tera, String>> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let mut t = tera::Tera::default();
        t.autoescape_on(vec![]);
        t.add_raw_templates(templates()).map_err(|e| error_chain(&e))?;
        Ok(t)
    })
}

/// Tera's error with all its causes on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        cur = s.source();
    }
    msg
}

/// Renders the CUDA source of `spec` after validating it.
///
/// # Errors
/// [`Error::InvalidSpec`] for a combination the templates do not support, [`Error::Render`]
/// when a template fails (a bug in the template, reported with Tera's message).
pub fn render(spec: &KernelSpec) -> Result<String> {
    spec.validate()?;
    let fam = spec.family();
    let render_err =
        |message: String| Error::Render { kernel: spec.name(), template: fam.template().to_string(), message };
    let tera = engine().as_ref().map_err(|m| render_err(m.clone()))?;
    let mut ctx = tera::Context::new();
    ctx.insert("name", &spec.name());
    ctx.insert("arch", &fam.arch().sm_number());
    ctx.insert("spec_hash", &spec.hash());
    fam.context(&mut ctx);
    // The `extern "C"` parameter list of each entry point, from the family's declaration.
    let params: Vec<String> = (0..fam.entry_suffixes().len())
        .map(|e| fam.params(e).iter().map(|a| a.declaration()).collect::<Vec<_>>().join(", "))
        .collect();
    ctx.insert("params", &params);
    tera.render(fam.template(), &ctx).map_err(|e| render_err(error_chain(&e)))
}
