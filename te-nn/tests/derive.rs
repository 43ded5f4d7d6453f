//! `#[derive(Module)]` on model structs of host-side mock leaves (no GPU): paths, `Vec` and
//! array indices, `None` skipped, `#[module(skip)]`, tuple and generic structs, counts,
//! `zero_grad` through `visit_mut`, a visitor's error stopping the traversal, and the kernel list
//! (`kernel_specs`) as the union of the visited fields' lists.

// Test code: a panic (unwrap, expect) is how a test reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use te_nn::modules::{
    join_path, KernelSpec, KernelTarget, LinearConfig, ModuleVisitor, ModuleVisitorMut, NamedParameter, NormConfig,
    NormKind, Param, ParamKind, ParamMut,
};
use te_nn::Module;
use te_runtime::{Arch, DType, Error, Result, Tensor};

/// A parameter held on the host: a shape and whether a gradient has accumulated.
#[derive(Debug)]
struct HostParam {
    shape: Vec<usize>,
    has_grad: bool,
}

impl HostParam {
    fn new(shape: &[usize]) -> Self {
        Self { shape: shape.to_vec(), has_grad: true }
    }
}

impl Param for HostParam {
    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn dtype(&self) -> DType {
        DType::BF16
    }

    fn tensor(&self) -> Option<&Tensor> {
        None
    }

    fn grad(&self) -> Option<&Tensor> {
        None
    }
}

impl ParamMut for HostParam {
    fn set(&mut self, _: Tensor) -> Result<()> {
        Err(Error::Config { module: "HostParam", message: "host mock: no device tensor".into() })
    }

    fn zero_grad(&mut self) {
        self.has_grad = false;
    }
}

/// A hand-written leaf: weight `[out, in]` and an optional bias `[out]`, or a norm.
#[derive(Debug)]
struct Leaf {
    weight: HostParam,
    bias: Option<HostParam>,
    norm: bool,
}

impl Leaf {
    fn linear(n_in: usize, n_out: usize, bias: bool) -> Self {
        Self { weight: HostParam::new(&[n_out, n_in]), bias: bias.then(|| HostParam::new(&[n_out])), norm: false }
    }

    fn norm(hidden: usize) -> Self {
        Self { weight: HostParam::new(&[hidden]), bias: Some(HostParam::new(&[hidden])), norm: true }
    }

    fn kinds(&self) -> [ParamKind; 2] {
        if self.norm {
            [ParamKind::NormWeight, ParamKind::NormBias]
        } else {
            [ParamKind::Weight, ParamKind::Bias]
        }
    }

    fn grads(&self) -> Vec<bool> {
        std::iter::once(&self.weight).chain(&self.bias).map(|p| p.has_grad).collect()
    }
}

impl Module for Leaf {
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        let [w, b] = self.kinds();
        visitor.param(&join_path(prefix, "weight"), w, &self.weight)?;
        if let Some(bias) = &self.bias {
            visitor.param(&join_path(prefix, "bias"), b, bias)?;
        }
        Ok(())
    }

    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()> {
        let [w, b] = self.kinds();
        visitor.param(&join_path(prefix, "weight"), w, &mut self.weight)?;
        if let Some(bias) = &mut self.bias {
            visitor.param(&join_path(prefix, "bias"), b, bias)?;
        }
        Ok(())
    }

    /// A hand-written leaf's own kernels, from the module configs' lists.
    fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        let params_dtype = target.params_dtype;
        match self.weight.shape[..] {
            [hidden] => {
                NormConfig { params_dtype, ..NormConfig::new(hidden) }.kernel_specs(NormKind::LayerNorm, target, specs)
            }
            [n_out, n_in] => LinearConfig { bias: self.bias.is_some(), params_dtype, ..LinearConfig::new(n_in, n_out) }
                .kernel_specs(target, specs),
            _ => unreachable!("leaves are 1-d norms or 2-d linears"),
        }
    }
}

#[derive(Module)]
struct Mlp {
    fc1: Leaf,
    fc2: Leaf,
}

#[derive(Module)]
struct Block {
    #[module(skip)]
    layer_number: usize,
    norm: Leaf,
    mlp: Mlp,
    #[module(skip)]
    name: String,
}

#[derive(Module)]
struct Model {
    embed: Leaf,
    layers: Vec<Block>,
    final_norm: Option<Leaf>,
    heads: [Leaf; 2],
    extra: Box<Leaf>,
    r#type: Leaf,
    #[module(skip)]
    config: (usize, usize),
}

#[derive(Module)]
struct Pair(Leaf, #[module(skip)] u32, Leaf);

#[derive(Module)]
struct Stack<T> {
    first: T,
    rest: Vec<T>,
    #[module(skip)]
    depth: usize,
}

#[derive(Module)]
struct Nothing;

#[derive(Module)]
struct Frozen {
    used: Leaf,
    #[module(skip)]
    frozen: Leaf,
}

const H: usize = 8;
const F: usize = 32;

fn block(i: usize) -> Block {
    Block {
        layer_number: i + 1,
        norm: Leaf::norm(H),
        mlp: Mlp { fc1: Leaf::linear(H, F, true), fc2: Leaf::linear(F, H, false) },
        name: format!("block{i}"),
    }
}

fn model(final_norm: bool) -> Model {
    Model {
        embed: Leaf::linear(100, H, false),
        layers: (0..2).map(block).collect(),
        final_norm: final_norm.then(|| Leaf::norm(H)),
        heads: [Leaf::linear(H, 3, true), Leaf::linear(H, 5, false)],
        extra: Box::new(Leaf::linear(H, H, true)),
        r#type: Leaf::linear(H, 1, false),
        config: (H, F),
    }
}

fn paths(m: &impl Module) -> Vec<String> {
    m.named_parameters().into_iter().map(|p| p.path).collect()
}

#[test]
fn paths_follow_fields_indices_and_options() {
    let layer = |i: usize| {
        ["norm.weight", "norm.bias", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight"]
            .map(|p| format!("layers.{i}.{p}"))
    };
    let mut want = vec!["embed.weight".to_string()];
    want.extend(layer(0));
    want.extend(layer(1));
    want.extend(["final_norm.weight", "final_norm.bias"].map(String::from));
    want.extend(
        ["heads.0.weight", "heads.0.bias", "heads.1.weight", "extra.weight", "extra.bias", "type.weight"]
            .map(String::from),
    );
    assert_eq!(paths(&model(true)), want);

    let without: Vec<String> = want.iter().filter(|p| !p.starts_with("final_norm")).cloned().collect();
    assert_eq!(paths(&model(false)), without, "a None Option adds nothing");
}

#[test]
fn skipped_fields_are_not_visited_and_tuple_fields_use_indices() {
    let b = block(0);
    assert_eq!((b.layer_number, b.name.as_str()), (1, "block0"));
    assert_eq!(paths(&b), ["norm.weight", "norm.bias", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight"]);

    let pair = Pair(Leaf::linear(2, 3, true), 7, Leaf::linear(3, 4, false));
    assert_eq!(pair.1, 7);
    assert_eq!(paths(&pair), ["0.weight", "0.bias", "2.weight"]);

    assert!(paths(&Nothing).is_empty());
    assert_eq!(Nothing.num_parameters(), 0);
}

#[test]
fn generic_structs_are_visited_through_their_fields() {
    let s = Stack { first: Leaf::linear(2, 2, false), rest: vec![Leaf::linear(2, 2, true)], depth: 2 };
    assert_eq!(s.depth, 2);
    assert_eq!(paths(&s), ["first.weight", "rest.0.weight", "rest.0.bias"]);
    let nested = Stack { first: block(0), rest: Vec::new(), depth: 1 };
    assert_eq!(paths(&nested)[0], "first.norm.weight");
}

#[test]
fn named_parameters_and_num_parameters() {
    let m = model(true);
    let named = m.named_parameters();
    assert_eq!(
        named[1],
        NamedParameter {
            path: "layers.0.norm.weight".into(),
            kind: ParamKind::NormWeight,
            shape: vec![H],
            dtype: DType::BF16
        }
    );
    assert_eq!(named[3].kind, ParamKind::Weight);
    assert_eq!(named[3].shape, [F, H]);
    assert_eq!(named[4].kind, ParamKind::Bias);

    let per_layer = 2 * H + (F * H + F) + H * F;
    let want = 100 * H + 2 * per_layer + 2 * H + (3 * H + 3) + 5 * H + (H * H + H) + H;
    assert_eq!(m.num_parameters(), want);
    assert_eq!(model(false).num_parameters(), want - 2 * H);
    assert_eq!(m.config, (H, F), "a skipped field keeps its value");
    assert_eq!(named.iter().map(|p| p.shape.iter().product::<usize>()).sum::<usize>(), want);
}

#[test]
fn visit_and_visit_mut_reach_the_same_paths_under_a_prefix() {
    let mut m = model(true);
    let mut read = Vec::new();
    m.visit("model", &mut |path: &str, _: ParamKind, _: &dyn Param| -> Result<()> {
        read.push(path.to_owned());
        Ok(())
    })
    .unwrap();
    let mut written = Vec::new();
    m.visit_mut("model", &mut |path: &str, _: ParamKind, _: &mut dyn ParamMut| -> Result<()> {
        written.push(path.to_owned());
        Ok(())
    })
    .unwrap();
    assert_eq!(read, written);
    assert_eq!(read[0], "model.embed.weight");
    assert_eq!(read.iter().map(|p| p.replacen("model.", "", 1)).collect::<Vec<_>>(), paths(&m));
}

#[test]
fn zero_grad_reaches_every_parameter() {
    let mut m = model(true);
    m.zero_grad();
    let leaves = [&m.embed, &m.layers[1].norm, &m.layers[1].mlp.fc1, &m.heads[0], &m.heads[1], &m.extra, &m.r#type];
    for leaf in leaves.into_iter().chain(&m.final_norm) {
        assert!(leaf.grads().iter().all(|g| !g), "{leaf:?}");
    }
}

#[test]
fn a_visitor_error_stops_the_traversal() {
    let mut m = model(true);
    let mut seen = 0;
    let r = m.visit_mut("", &mut |path: &str, _: ParamKind, _: &mut dyn ParamMut| -> Result<()> {
        seen += 1;
        if path == "layers.0.mlp.fc1.weight" {
            return Err(Error::Argument { op: "test", message: path.into() });
        }
        Ok(())
    });
    assert!(matches!(r, Err(Error::Argument { ref message, .. }) if message == "layers.0.mlp.fc1.weight"), "{r:?}");
    assert_eq!(seen, 4, "embed.weight, layers.0.norm.{{weight,bias}}, layers.0.mlp.fc1.weight");
}

#[test]
fn boxed_trait_objects_are_modules() {
    let layers: Vec<Box<dyn Module>> = vec![Box::new(block(0)), Box::new(Leaf::linear(H, H, true))];
    let p = paths(&layers);
    assert_eq!(p.first().map(String::as_str), Some("0.norm.weight"));
    assert_eq!(&p[p.len() - 2..], ["1.weight", "1.bias"]);
}

/// The sorted, deduplicated union of the kernel lists of `leaves`.
fn union(leaves: &[&Leaf], target: &KernelTarget) -> Vec<KernelSpec> {
    let mut specs: Vec<KernelSpec> = leaves.iter().flat_map(|l| l.kernel_specs_for(target)).collect();
    specs.sort();
    specs.dedup();
    specs
}

#[test]
fn kernel_specs_are_the_union_of_the_visited_fields() {
    let target = KernelTarget::new(128, Arch::Sm90a);
    let mlp = Mlp { fc1: Leaf::linear(H, F, true), fc2: Leaf::linear(F, H, false) };
    let specs = mlp.kernel_specs_for(&target);
    assert_eq!(specs, union(&[&mlp.fc1, &mlp.fc2], &target));
    assert!(specs.len() > mlp.fc1.kernel_specs_for(&target).len(), "fc2 adds its own sizes");

    // Vec, Option, arrays, Box and raw identifiers recurse; `None` adds nothing.
    let m = model(true);
    let mut leaves = vec![&m.embed, &m.heads[0], &m.heads[1], &*m.extra, &m.r#type];
    for b in &m.layers {
        leaves.extend([&b.norm, &b.mlp.fc1, &b.mlp.fc2]);
    }
    assert_eq!(model(false).kernel_specs_for(&target), union(&leaves, &target));
    assert!(None::<Leaf>.kernel_specs_for(&target).is_empty());
    assert!(Nothing.kernel_specs_for(&target).is_empty());

    // Sorted and deduplicated.
    let mut raw = Vec::new();
    m.kernel_specs(&target, &mut raw);
    let n = m.kernel_specs_for(&target).len();
    assert!(raw.len() > n, "{} raw, {n} unique", raw.len());
}

#[test]
fn skipped_fields_add_no_kernels() {
    let target = KernelTarget::new(128, Arch::Sm90a);
    let m = Frozen { used: Leaf::linear(H, F, true), frozen: Leaf::linear(3 * F, 5 * F, true) };
    assert_eq!(m.kernel_specs_for(&target), m.used.kernel_specs_for(&target));
    let frozen_only = m.frozen.kernel_specs_for(&target);
    let transposes = |specs: &[KernelSpec]| specs.iter().filter(|s| matches!(s, KernelSpec::CastTranspose(_))).count();
    assert!(transposes(&frozen_only) > 0);
    assert!(!m
        .kernel_specs_for(&target)
        .iter()
        .any(|s| frozen_only.contains(s) && matches!(s, KernelSpec::CastTranspose(_))));
}
