//! [`Module`] for containers of modules: slices, `Vec`s and arrays (children named by their index),
//! `Option` (nothing when absent) and `Box`.

use super::{join_path, Module, ModuleVisitor, ModuleVisitorMut};
use crate::modules::{KernelSpec, KernelTarget};
use te_runtime::Result;

impl<T: Module> Module for [T] {
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        for (i, m) in self.iter().enumerate() {
            m.visit(&join_path(prefix, &i.to_string()), visitor)?;
        }
        Ok(())
    }

    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()> {
        for (i, m) in self.iter_mut().enumerate() {
            m.visit_mut(&join_path(prefix, &i.to_string()), visitor)?;
        }
        Ok(())
    }

    fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        for m in self {
            m.kernel_specs(target, specs);
        }
    }
}

impl<T: Module> Module for Vec<T> {
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        self.as_slice().visit(prefix, visitor)
    }

    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()> {
        self.as_mut_slice().visit_mut(prefix, visitor)
    }

    fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        self.as_slice().kernel_specs(target, specs);
    }
}

impl<T: Module, const N: usize> Module for [T; N] {
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        self.as_slice().visit(prefix, visitor)
    }

    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()> {
        self.as_mut_slice().visit_mut(prefix, visitor)
    }

    fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        self.as_slice().kernel_specs(target, specs);
    }
}

impl<T: Module> Module for Option<T> {
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        self.as_ref().map_or(Ok(()), |m| m.visit(prefix, visitor))
    }

    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()> {
        self.as_mut().map_or(Ok(()), |m| m.visit_mut(prefix, visitor))
    }

    fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        if let Some(m) = self {
            m.kernel_specs(target, specs);
        }
    }
}

impl<T: Module + ?Sized> Module for Box<T> {
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        (**self).visit(prefix, visitor)
    }

    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()> {
        (**self).visit_mut(prefix, visitor)
    }

    fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        (**self).kernel_specs(target, specs);
    }
}
