//! Rendering specs to CUDA C++ with Tera.
//!
//! Templates are embedded in the binary (so a binary built here renders the same source on
//! the GPU machine), autoescape is off, and an undefined variable is an error.

use crate::spec::KernelSpec;
use crate::{Error, Result};
use std::sync::OnceLock;

/// Every template, by file name under `te-codegen/templates/`.
pub const TEMPLATES: &[(&str, &str)] = &[
    ("common.cuh.tera", include_str!("../templates/common.cuh.tera")),
    ("cast.cu.tera", include_str!("../templates/cast.cu.tera")),
    ("cast_transpose.cu.tera", include_str!("../templates/cast_transpose.cu.tera")),
    ("activation.cu.tera", include_str!("../templates/activation.cu.tera")),
    ("norm_fwd.cu.tera", include_str!("../templates/norm_fwd.cu.tera")),
    ("norm_bwd.cu.tera", include_str!("../templates/norm_bwd.cu.tera")),
    ("softmax.cu.tera", include_str!("../templates/softmax.cu.tera")),
    ("scaling.cu.tera", include_str!("../templates/scaling.cu.tera")),
    ("elementwise.cu.tera", include_str!("../templates/elementwise.cu.tera")),
    ("transpose.cu.tera", include_str!("../templates/transpose.cu.tera")),
    ("rope.cu.tera", include_str!("../templates/rope.cu.tera")),
    ("philox.cuh.tera", include_str!("../templates/philox.cuh.tera")),
    ("dropout.cu.tera", include_str!("../templates/dropout.cu.tera")),
    ("optimizer.cu.tera", include_str!("../templates/optimizer.cu.tera")),
    ("embedding.cu.tera", include_str!("../templates/embedding.cu.tera")),
    ("cross_entropy.cu.tera", include_str!("../templates/cross_entropy.cu.tera")),
];

fn engine() -> &'static std::result::Result<tera::Tera, String> {
    static ENGINE: OnceLock<std::result::Result<tera::Tera, String>> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let mut t = tera::Tera::default();
        t.autoescape_on(vec![]);
        t.add_raw_templates(TEMPLATES.iter().copied()).map_err(|e| error_chain(&e))?;
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
    tera.render(fam.template(), &ctx).map_err(|e| render_err(error_chain(&e)))
}
